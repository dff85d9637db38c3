"""The boxing table (graphc/sbp/boxing.py) is complete: every kind runs, every dual is a kind."""
import itertools

from graphc.placement import Broadcast, PartialSum, Split
from graphc.ops import conversions as ops
from graphc.sbp.boxing import BOXINGS, backward_collective, kind_of
from graphc.sbp.cost import moved_bytes

LAYOUTS = [Broadcast(), PartialSum(), Split(0), Split(1)]


def test_every_kind_has_a_runner_and_every_dual_is_a_kind():
    assert set(ops._RUN) == set(BOXINGS)
    for box in BOXINGS.values():
        assert box.dual is None or box.dual in BOXINGS, box.kind
        assert box.collective is None or box.collective in BOXINGS, box.kind


def test_kind_of_names_a_row_for_every_conversion():
    for src, dst in itertools.product(LAYOUTS, LAYOUTS):
        if src != dst:
            assert kind_of(src, dst) in BOXINGS, (src, dst)


def test_local_conversions_send_nothing_and_collectives_do():
    for box in BOXINGS.values():
        sends = moved_bytes(box.collective, 1 << 20, 4) > 0
        assert sends == (box.collective is not None), box.kind
    assert backward_collective("all_gather") is None          # its dual is a local slice
    assert backward_collective("reduce_scatter") == "all_gather"
    assert backward_collective("grad_all_reduce") == "all_reduce"
