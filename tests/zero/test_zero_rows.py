"""ZeRO stage 2 on gloo runs each bucket rank by rank on views (NOTE: ZeRO rows in place,
graphc/runtime/zero_rows.py): the reduce-scatter as per-rank reduces in the gradients, the
gather after the step as per-rank broadcasts into the parameters. On 2 real gloo ranks (the
only world with those calls; a local world takes the packed path) it equals eager on the
whole batch in float64 at 1e-10 (helpers.py), with the uneven weight (33 rows on 2 ranks),
accumulation 4, Adam and clipping; and the bucket's collectives are the per-rank ones."""
import pytest

import graphc.runtime.zero_rows as zero_rows
from helpers import run_world
from test_zero_numerics import _check, _data_parallel

CONFIG = [(2, 4, "adam", True)]


def _counted(rank, world, configs):
    calls = {"reduce": 0, "broadcast": 0}
    launch_next, broadcast_rows = zero_rows.ReducedRows.launch_next, zero_rows.launch_broadcast_rows

    def reduce(self, grad):
        calls["reduce"] += 1
        return launch_next(self, grad)

    def broadcast(*args):
        calls["broadcast"] += 1
        return broadcast_rows(*args)

    import graphc.runtime.zero as zero
    zero_rows.ReducedRows.launch_next = reduce   # each parameter's reduces, as its gradient is final
    zero.launch_broadcast_rows = broadcast
    out = _data_parallel(rank, world, configs)
    out["calls"] = calls
    return out


@pytest.mark.world
@pytest.mark.slow  # ZeRO-2 on gloo by default: tests/local/test_local_vs_gloo.py::test_local_world_is_bitwise_gloo[2]
def test_zero_2_rows_in_place_on_gloo_equals_eager():
    results = run_world(_counted, 2, CONFIG)
    _check(results, CONFIG, "data 2, rows in place")
    for res in results:   # every step's buckets went rank by rank (3 steps)
        assert res["calls"]["reduce"] >= 3 and res["calls"]["broadcast"] >= 3, res["calls"]
