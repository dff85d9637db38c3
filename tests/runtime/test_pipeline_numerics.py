"""Pipelines on real gloo processes train exactly like eager PyTorch on the whole batch."""
import pytest
import torch

from helpers import FP32_ATOL, assert_same_as_eager, eager_train, fp32_bound, graphc_train, run_world
from models import OPTIMIZERS, PipelineGraph, SkipNet, make_batches, make_sched

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

ACCUMULATION = (1, 2, 4, 8)
STEPS = 3


def _train_configs(rank, world, schedule):
    out = {}
    batches = make_batches()
    for acc in ACCUMULATION:
        for opt_name, make_opt in OPTIMIZERS.items():
            torch.manual_seed(0)
            model = SkipNet(world)
            opt = make_opt(model.parameters())
            graph = PipelineGraph(model, opt, make_sched(opt), acc, schedule)
            losses, state = graphc_train(graph, batches, STEPS)
            out[(acc, opt_name)] = {"losses": losses, "state": state,
                                    "live": graph.last_stats.max_live_activations}
    return out


# CI time: -m slow; pipelines on gloo run in tests/test_semantics_gloo.py (pp2) and the GPT's
# pp2 in tests/examples/test_gpt.py, every schedule in the local sweep
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_matches_eager(world, schedule):
    results = run_world(_train_configs, world, schedule)
    batches = make_batches()
    last = results[world - 1]
    for (acc, opt_name), got in last.items():
        torch.manual_seed(0)
        ref_losses, ref_state = eager_train(SkipNet(world), OPTIMIZERS[opt_name], make_sched,
                                            torch.nn.CrossEntropyLoss(), batches, STEPS)
        what = f"p={world} {schedule} acc={acc} {opt_name}"
        assert_same_as_eager(got["losses"], got["state"], ref_losses, ref_state, what)
        # every rank's full_state_dict is the same complete model
        for r in range(world - 1):
            for k, v in results[r][(acc, opt_name)]["state"].items():
                torch.testing.assert_close(v, got["state"][k], atol=0, rtol=0)
        # activation memory: stage s holds at most min(p - s, m) (1F1B) or m (GPipe) micro-batches
        for r in range(world):
            live = results[r][(acc, opt_name)]["live"][r]   # the last step's
            bound = min(world - r, acc) if schedule == "1f1b" else acc
            assert live == bound, f"{what}: stage {r} held {live} micro-batches, expected {bound}"


def _train_fp32(rank, world):
    torch.manual_seed(0)
    model = SkipNet(world)
    opt = OPTIMIZERS["sgd_momentum"](model.parameters())
    losses, state = graphc_train(PipelineGraph(model, opt, None, 2, "1f1b"), make_batches())
    return {"losses": losses, "state": state}


@pytest.mark.fp32
def test_fp32_smoke_pipeline_within_the_written_bound():
    """The fp32 smoke set: float32 end to end (model, data, gloo), SGD only (see helpers)."""
    assert torch.get_default_dtype() == torch.float32
    assert fp32_bound(terms=64, steps=STEPS) <= FP32_ATOL, "the tolerance covers the bound"
    got = run_world(_train_fp32, 2)[1]
    torch.manual_seed(0)
    ref_losses, ref_state = eager_train(SkipNet(2), OPTIMIZERS["sgd_momentum"], None,
                                        torch.nn.CrossEntropyLoss(), make_batches(), STEPS)
    assert all(v.dtype == torch.float32 for v in got["state"].values() if v.is_floating_point())
    assert_same_as_eager(got["losses"], got["state"], ref_losses, ref_state, "fp32 p=2 acc=2")
