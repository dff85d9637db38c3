"""Programs without set_stage on real gloo processes train exactly like eager PyTorch.

Each op runs where its inputs and parameters are placed (passes/place_by_layout.py): here
Linear modules declared with to_global on ranks [0] and [1], a relu with no parameter after
the to_global (it runs on [1], where its input was moved), and plain inputs and an
undeclared head that go where their users run. Float64, 1e-10 (helpers.py). Seed 003's
program in both tabs: tests/examples/test_global_tensors.py.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from helpers import assert_same_as_eager, eager_train, graphc_train, run_world
from models import OPTIMIZERS

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

P0, P1 = graphc.placement("cpu", ranks=[0]), graphc.placement("cpu", ranks=[1])
STEPS = 3


class Placed(nn.Module):
    def __init__(self, placed: bool = True):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)      # never declared: runs with its input, on [1]
        self.placed = placed             # False: the eager reference, on one process
        if placed:
            graphc.to_global(self.a, placement=P0, sbp=sbp.broadcast)
            graphc.to_global(self.b, placement=P1, sbp=sbp.broadcast)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.placed:
            h = graphc.to_global(h, placement=P1, sbp=sbp.broadcast)
        return self.head(self.b(F.relu(h)))


class Train(graphc.Graph):
    def __init__(self, model, opt, accumulation):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(STEPS)]


def _train(rank, world, accumulation):
    torch.manual_seed(0)
    model = Placed()
    graph = Train(model, OPTIMIZERS["adam"](model.parameters()), accumulation)
    losses, state = graphc_train(graph, batches())
    return {"losses": losses, "state": state, "stages": [s.ranks for s in graph.compiled.stages]}


def test_ops_follow_their_placements_and_train_like_eager(accumulation=2):
    results = run_world(_train, 2, accumulation)
    torch.manual_seed(0)
    ref_losses, ref_state = eager_train(Placed(placed=False), OPTIMIZERS["adam"], None,
                                        nn.CrossEntropyLoss(), batches(), STEPS)
    for rank, got in enumerate(results):
        assert got["stages"] == [(0,), (1,)]
        assert bool(got["losses"]) == (rank == 1)   # the loss runs where the head does
        assert_same_as_eager(got["losses"] or ref_losses, got["state"], ref_losses, ref_state,
                             f"rank {rank}, accumulation {accumulation}")
