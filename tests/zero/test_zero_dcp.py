"""Checkpoints of ZeRO graphs in torch.distributed.checkpoint (DCP) move to other layouts and
back (See NOTE: ZeRO state in checkpoints, graphc/checkpoint/dcp.py).

tests/zero/test_zero_numerics.py's Net (fc1 33 x 16 and fc2 24 x 33 uneven over 2 ranks,
head 3 x 24: 2 rows and 1) trains N steps in eager PyTorch on the whole batch with Adam and
gradient clipping, accumulation 2: the oracle (float64, 1e-10, helpers.py). graphc runs the
same steps in pieces, handing over through dcp.save / dcp.load of graph.state_dict():

  data 2 (and 4, slow), ZeRO stage 2: K steps, dcp.save -> A (Adam's state as row shards);
      the same world resumes from A in a fresh ZeRO graph of another seed, bit for bit like
      its unbroken run;
  one process (no ZeRO): loads A, trains one step, dcp.save -> B, trains to N;
  data 2 without ZeRO: loads A, trains to N; data 2 at ZeRO stage 1 loads B (whole state)
      and trains to N.

Every piece ends where eager ends.
"""
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

import graphc
from helpers import assert_same_as_eager, run_world
from test_zero_numerics import MAX_NORM, Net, batches, rows

N, K, ACCUMULATION = 4, 2, 2


class Train(graphc.Graph):
    def __init__(self, model, zero):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(ACCUMULATION)
        self.config.set_grad_clip_norm(MAX_NORM)
        if zero:
            self.config.enable_zero(True, stage=zero, shard_min_size=64)
        self.add_optimizer(torch.optim.Adam(model.parameters(), lr=0.01))

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def make(rank, world, zero, seed=0):
    """(graph, feed): data `world` (one process: world 1, plain tensors)."""
    torch.manual_seed(seed)
    if world == 1:
        return Train(Net(), zero), lambda x, y: (x, y)
    where = graphc.placement("cpu", list(range(world)))
    model = graphc.to_global(Net(), placement=where, sbp=graphc.sbp.broadcast)
    return Train(model, zero), lambda x, y: tuple(
        graphc.to_global(rows(t, rank, world), placement=where, sbp=graphc.sbp.split(0)) for t in (x, y))


def steps(graph, feed, first, last):
    data = batches(N)   # made here: a spawned rank imports this file before its dtype is set
    return [graph(*feed(*data[step])).to_local().item() for step in range(first, last)]


def load(graph, feed, checkpoint, first):
    graph.compile(*feed(*batches(N)[first]))      # the layout's state dict, to fill
    sd = graph.state_dict()
    dcp.load(sd, checkpoint_id=checkpoint)
    graph.load_state_dict(sd)


def _save(rank, world, a):
    graph, feed = make(rank, world, zero=2)
    losses = steps(graph, feed, 0, K)
    sd = graph.state_dict()
    dcp.save(sd, checkpoint_id=a)
    losses += steps(graph, feed, K, N)
    resumed, feed = make(rank, world, zero=2, seed=1)
    load(resumed, feed, a, K)
    return {"losses": losses, "state": graph.full_state_dict(), "again": steps(resumed, feed, K, N),
            "resumed": resumed.full_state_dict(),
            "exp_avg": type(sd["optim"]["state"]["fc1.weight"]["exp_avg"]).__name__}


def _resume(rank, world, a, b):
    out = {}
    for zero, checkpoint, first in ((0, a, K), (1, b, K + 1)):
        graph, feed = make(rank, world, zero, seed=1)
        load(graph, feed, checkpoint, first)
        out[zero] = {"losses": steps(graph, feed, first, N), "state": graph.full_state_dict()}
    return out


def eager():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for x, y in batches(N):
        opt.zero_grad()
        loss = sum(F.cross_entropy(model(xm), ym) for xm, ym in zip(x.chunk(ACCUMULATION),
                                                                    y.chunk(ACCUMULATION)))
        (loss / ACCUMULATION).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        losses.append(loss.item() / ACCUMULATION)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.world
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])   # CI time: test_zero3_dcp resumes ZeRO in other layouts
def test_a_zero_checkpoint_resumes_in_other_layouts_and_back(world, tmp_path):
    """world 4: head's 3 rows are 1, 1, 1 and none (rank 3 saves an empty block)."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ref_losses, ref_state = eager()
    saved = run_world(_save, world, a)
    for rank, got in enumerate(saved):
        assert got["exp_avg"] == "DTensor", "ZeRO's optimizer state is saved as shards"
        assert_same_as_eager(got["losses"], got["state"], ref_losses, ref_state, f"zero 2 data {world} rank {rank}")
        assert got["again"] == got["losses"][K:], f"rank {rank}: resumed losses differ"
        for k, v in got["state"].items():   # same layout: exactly the unbroken run's numbers
            assert torch.equal(got["resumed"][k], v), f"rank {rank}: {k} differs after dcp resume"

    graph, feed = make(0, 1, zero=0, seed=1)    # one process, from ZeRO's shards
    load(graph, feed, a, K)
    losses = steps(graph, feed, K, K + 1)
    dcp.save(graph.state_dict(), checkpoint_id=b)
    losses += steps(graph, feed, K + 1, N)
    assert_same_as_eager(losses, graph.full_state_dict(), ref_losses[K:], ref_state,
                         f"one process resumed from ZeRO stage 2 on data {world}")
    assert os.path.isdir(b)

    resumed = run_world(_resume, 2, a, b)
    for rank, got in enumerate(resumed):
        assert_same_as_eager(got[0]["losses"], got[0]["state"], ref_losses[K:], ref_state,
                             f"data 2 without ZeRO from ZeRO stage 2 on data {world}, rank {rank}")
        assert_same_as_eager(got[1]["losses"], got[1]["state"], ref_losses[K + 1:], ref_state,
                             f"data 2 at ZeRO stage 1 from one process, rank {rank}")
