"""examples/global_tensors.py: seed 003's hybrid program on 4 gloo ranks equals eager PyTorch.

Both of the guide's tabs: the global program without set_stage (graphc finds the stages from
the placements, NOTE: Stages from placements in passes/place_by_layout.py) and the Graph with
set_stage, with accumulation 1 and 2. Each trains 3 SGD steps; losses and the full state
dict are compared with eager PyTorch on the whole batch in float64 at 1e-10 (helpers.py).
"""
import os
import sys

import pytest

from helpers import assert_same_as_eager, run_world

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

STEPS = 3


def _train(rank, world, accumulation):
    import global_tensors
    return {tab: global_tensors.main(STEPS, set_stage=tab == "set_stage", accumulation=accumulation)
            for tab in ("global", "set_stage")}


@pytest.mark.parametrize("accumulation", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_seed_003_hybrid_in_both_tabs_trains_like_eager(accumulation):
    results = run_world(_train, 4, accumulation)
    ref = results[0]["global"]["reference"]
    for tab in ("global", "set_stage"):
        for rank, res in enumerate(results):
            got = res[tab]
            what = f"{tab} program, accumulation {accumulation}, rank {rank}"
            # the loss lives on stage 1 (ranks 2, 3); every rank gets the full state
            assert bool(got["losses"]) == (rank in (2, 3)), what
            assert_same_as_eager(got["losses"] or ref["losses"], got["state"],
                                 ref["losses"], ref["state"], what)
    printed = results[0]["global"]["printed"]
    assert "stages found from placements: stage 0 = ranks [0, 1]" in printed, printed
    assert "stage 1 = ranks [2, 3]" in printed, printed
    assert "stages found" not in results[0]["set_stage"]["printed"]
