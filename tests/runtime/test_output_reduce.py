"""The data-parallel loss is summed once per step (insert_output_reduce), never in a
micro-batch's forward, and the loss the user sees is still eager's on the whole batch
(float64, 1e-10): in the local world by default, on gloo under -m slow."""
import pytest
import torch
import torch.nn as nn

import graphc
import graphc.testing
from graphc.plan.instructions import AllReduce, OutputAllReduce
from graphc.runtime.local_world import LocalRank
from helpers import assert_same_as_eager, eager_train, feed_split, graphc_train, run_world
from models import OPTIMIZERS, make_batches

M, STEPS = 4, 3


class DataParallel(graphc.Graph):
    def __init__(self, model, world):
        super().__init__()
        self.model = graphc.to_global(model, placement=graphc.placement("cpu", list(range(world))),
                                      sbp=graphc.sbp.broadcast)
        self.loss_fn = nn.CrossEntropyLoss()
        self.config.set_gradient_accumulation_steps(M)
        self.add_optimizer(OPTIMIZERS["adam"](self.model.parameters()))

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 5))


def eager():
    return eager_train(make_model(), OPTIMIZERS["adam"], None, nn.CrossEntropyLoss(), make_batches(STEPS), STEPS)


def collectives_in(plan):
    """(output sums, gradient buckets) of a plan, and its sums' rows."""
    sums = [ins for ins in plan.instructions if isinstance(ins, OutputAllReduce)]
    return len(sums), sum(type(ins) is AllReduce for ins in plan.instructions), sums[0].tensors[0].shape


def test_the_loss_is_reduced_once_a_step_in_the_local_world(monkeypatch):
    calls = []
    real = LocalRank.all_reduce

    def counted(self, t, *args, **kw):   # every all-reduce a rank runs, in this in-memory world
        calls.append((self.rank, tuple(t.shape)))
        return real(self, t, *args, **kw)
    monkeypatch.setattr(LocalRank, "all_reduce", counted)
    split = [tuple(graphc.to_global(t.chunk(2)[r], placement=graphc.placement("cpu", [0, 1]),
                                    sbp=graphc.sbp.split(0)) for t in batch)
             for batch in make_batches(STEPS) for r in (0, 1)]
    run = graphc.testing.local_world(lambda: DataParallel(make_model(), 2),
                                     lambda rank, step: split[2 * step + rank], 2, steps=STEPS)
    want_losses, want_state = eager()
    assert_same_as_eager(run.losses, run.state, want_losses, want_state, "local data 2")
    for rank, graph in enumerate(run.graphs):
        assert collectives_in(graph.plan) == (1, 1, (M,))
        assert [out.to_local().item() for out in run.outputs[rank]] == run.losses   # alike on both
    # per rank and step: the whole batch's target count (the prologue a token-mean loss
    # divides by), the gradient bucket, and the loss's sum of all M micro-batches
    for rank in (0, 1):
        assert sorted(shape for r, shape in calls if r == rank) == sorted([(), (709,), (M,)] * STEPS)

def _gloo_rank(rank, world):
    where = graphc.placement("cpu", list(range(world)))
    graph = DataParallel(make_model(), world)
    losses, state = graphc_train(graph, make_batches(STEPS), feed=feed_split(where, rank))
    return losses, state, collectives_in(graph.plan)


# CI time: -m slow; data 2 on gloo runs by default, bitwise to the local world, in
# tests/local/test_local_vs_gloo.py, and the local world's case above counts the collectives
@pytest.mark.world
@pytest.mark.slow
def test_the_loss_is_reduced_once_a_step_on_gloo():
    want_losses, want_state = eager()
    for rank, (losses, state, collectives) in enumerate(run_world(_gloo_rank, 2)):
        assert_same_as_eager(losses, state, want_losses, want_state, f"gloo data 2 rank {rank}")
        assert collectives == (1, 1, (M,))
