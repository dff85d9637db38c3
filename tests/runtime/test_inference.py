"""A build() without backward() compiles a forward-only plan and returns eager's outputs."""
import pytest
import torch

import graphc
from helpers import ATOL, RTOL, run_world
from models import SkipNet

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)


class InferenceGraph(graphc.Graph):
    def __init__(self, model, accumulation):
        super().__init__()
        self.model = model
        for s in range(len(model.blocks)):
            self.model.blocks[s].config.set_stage(s, graphc.placement("cpu", [s]))
        self.model.head.config.set_stage(len(model.blocks) - 1, graphc.placement("cpu", [len(model.blocks) - 1]))
        self.config.set_gradient_accumulation_steps(accumulation)

    def build(self, x):
        return self.model(x)


def _infer(rank, world):
    torch.manual_seed(0)
    graph = InferenceGraph(SkipNet(world), accumulation=4)
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(3))
    out = graph(x)
    assert not graph.plan.training
    assert all(i.op in ("forward", "send", "recv") for i in graph.plan.instructions)
    return {"local": out.to_local(), "ranks": out.placement.ranks, "shape": tuple(out.shape)}


def test_forward_only_pipeline_matches_eager():
    results = run_world(_infer, 2)
    torch.manual_seed(0)
    model = SkipNet(2)
    with torch.no_grad():
        ref = model(torch.randn(16, 16, generator=torch.Generator().manual_seed(3)))
    assert results[0]["local"].numel() == 0 and results[1]["ranks"] == (1,)
    assert results[1]["shape"] == (16, 5)
    torch.testing.assert_close(results[1]["local"], ref, atol=ATOL, rtol=RTOL)
