"""insert_boxing and list_collectives in one process: the conversion chosen for each SBP pair."""
import os
import sys

import pytest
import torch

import graphc
from graphc import compiler, sbp
from graphc.meta import META_BOXING
from graphc.placement import Broadcast, PartialSum, Split
from graphc.plan.instructions import Collective
from graphc.sbp.boxing import kind_of

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from test_boxing import LAYOUTS, SHAPE, BoxingGraph, Model, _tensors

# plan-level checks of byte counts written for fp32 values (4 bytes): not numerics
pytestmark = pytest.mark.fp32

B, P = Broadcast(), PartialSum()

EXPECTED = {  # (src, dst) -> forward collective issued on a 2-rank placement (None: local)
    ("P", "B"): "all_reduce", ("P", "S0"): "reduce_scatter", ("P", "S1"): "reduce_scatter",
    ("S0", "B"): "all_gather", ("S1", "B"): "all_gather", ("S0", "S1"): "all_to_all",
    ("S1", "S0"): "all_to_all", ("B", "S0"): None, ("B", "S1"): None, ("B", "P"): None,
    ("S0", "P"): None, ("S1", "P"): None,
}


def test_kind_of_covers_every_pair():
    assert kind_of(P, B) == "all_reduce" and kind_of(P, Split(1)) == "reduce_scatter"
    assert kind_of(Split(0), B) == "all_gather" and kind_of(Split(0), Split(1)) == "all_to_all"
    assert kind_of(B, Split(0)) == "slice" and kind_of(B, P) == "to_partial"
    assert kind_of(Split(1), P) == "split_partial"


@pytest.mark.parametrize("pair", sorted(EXPECTED))
def test_conversion_between_pair_is_listed_in_the_plan(pair):
    a, b = pair
    w, c = _tensors()
    where = graphc.placement("cpu", [0, 1])
    graph = BoxingGraph(Model(w, c), LAYOUTS[a], LAYOUTS[b], where, where)
    cg = compiler.compile(graph, [torch.ones(SHAPE)], 2)
    boxes = [n.meta[META_BOXING] for n in cg.gm.graph.nodes if META_BOXING in n.meta]
    # the second to_global converts src -> dst with exactly one box
    assert any(str(info.src[0]) == str(LAYOUTS[a]) and str(info.dst[0]) == str(LAYOUTS[b])
               for info in boxes), [(i.src, i.dst, i.kind) for i in boxes]
    listed = [ins for ins in cg.plans[0].instructions if isinstance(ins, Collective)
              and ins.direction == "F" and ins.sbp_in == str(LAYOUTS[a])
              and ins.sbp_out == str(LAYOUTS[b])]
    if EXPECTED[pair] is None:
        assert not listed
    else:
        # (P -> B also reduces the partial_sum result v_src before build() returns it)
        assert {ins.kind for ins in listed} == {EXPECTED[pair]}
        ins = listed[0]
        full = SHAPE[0] * SHAPE[1] * 4
        want = {"all_reduce": full, "reduce_scatter": full // 2, "all_gather": full // 2,
                "all_to_all": full // 4}[ins.kind]
        assert ins.ranks == (0, 1) and ins.nbytes == want
        assert f"ranks=[0, 1] bytes={want}" in str(ins)


def test_an_inner_split_of_the_dim_an_outer_axis_cuts_is_gathered_and_cut_again():
    """(P, S(0)) -> (S(0), S(0)): a reduce-scatter of axis 0 would cut within axis 1's rows
    (rank (i, j) holding rows j*T/2 + i*T/4.., not i*T/2 + j*T/4..): axis 1 is gathered
    first and cut again last (HF Llama's logits on cp2 x tp2 with sequence parallelism)."""
    from graphc.passes.insert_boxing import _conversion_steps
    P, S0, S1, B = PartialSum(), Split(0), Split(1), Broadcast()
    assert _conversion_steps((P, S0), (S0, S0)) == [(1, B), (0, S0), (1, S0)]
    assert _conversion_steps((S0, S0), (B, S0)) == [(1, B), (0, B), (1, S0)]
    assert _conversion_steps((S1, S0), (S1, S1)) == [(1, S1)]          # another dim: as before
    assert _conversion_steps((P, S0), (S1, S0)) == [(0, S1)]
    # both axes move the sequence split to rows: the inner one is whole while the outer moves
    assert _conversion_steps((S1, S1), (S0, S0)) == [(1, S0), (1, B), (0, S0), (1, S0)]
