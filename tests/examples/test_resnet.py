"""examples/resnet.py (conv, BatchNorm, shortcuts, adaptive pooling) against eager, float64.

What BatchNorm equals (docs/design.md, BatchNorm):
  - data parallel, accumulation 1: the whole batch's statistics (sync-BN), i.e. eager on
    the whole batch, running statistics included;
  - pipeline with accumulation m: each micro-batch normalised with its own statistics and
    the running statistics updated once per micro-batch, i.e. eager gradient accumulation
    over the same m micro-batches.
"""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import accumulate_grads, assert_same_as_eager, run_world

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import resnet  # noqa: E402

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

STEPS, BATCH = 2, 8


def _train(rank, world, configs):
    out = {}
    for name, (pp, dp, acc) in configs.items():
        torch.manual_seed(0)
        model = resnet.ResNet()
        graph = resnet.ResNetGraph(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   pp, dp, acc)
        losses = []
        for x, y in resnet.data(STEPS, BATCH):
            loss = graph(*resnet.global_inputs(rank, pp, dp, x, y)).to_local()
            losses += [loss.item()] if loss.numel() else []
        out[name] = {"losses": losses, "state": graph.full_state_dict(), "plan": str(graph.plan)}
    return out


def _eager(acc):
    torch.manual_seed(0)
    model = resnet.ResNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in resnet.data(STEPS, BATCH):
        opt.zero_grad()
        losses.append(accumulate_grads(model, F.cross_entropy, x, y, acc))
        opt.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_resnet_pipeline_and_data_parallel_match_eager():
    configs = {"pp2-acc2": (2, 1, 2), "dp2-acc1": (1, 2, 1)}
    results = run_world(_train, 2, configs)
    for name, acc in (("pp2-acc2", 2), ("dp2-acc1", 1)):
        ref_losses, ref_state = _eager(acc)
        for rank, res in enumerate(results):
            got = res[name]
            losses = got["losses"] if got["losses"] else ref_losses
            assert_same_as_eager(losses, got["state"], ref_losses, ref_state, f"{name} rank {rank}")
    assert "fallback" not in results[0]["dp2-acc1"]["plan"], "a data-parallel ResNet op fell back"
