"""Checkpoints in torch.distributed.checkpoint (DCP) move between layouts and world sizes.

One model (fc1 6 -> 8, tanh, fc2 8 -> 3; Adam and StepLR; mean-squared error) trains N steps
in eager PyTorch on the whole batch: the oracle (float64, 1e-10, helpers.py). graphc runs
the same steps in pieces, each piece in another layout, handing over through dcp.save /
dcp.load of graph.state_dict():

  pipeline 2 x data 2 (4 ranks, 2 micro-batches): K steps, dcp.save -> A; the same world
      resumes from A in a fresh graph of another seed, bit for bit like its unbroken run;
  pipeline 2 (2 ranks, 2 micro-batches): loads A, trains to N;
  tensor 2 (2 ranks; fc1 split by rows, fc2 by rows too: 3 over 2 ranks, uneven): loads A,
      trains one step, dcp.save -> B (DTensor shards); trains to N;
  one process: loads B (the shards of the tensor-parallel run), trains to N.

Every piece ends where eager ends, and dcp_to_torch_save(A) loads into the plain eager model
with strict=True, equal to eager after K steps.
"""
import os
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from helpers import assert_close, assert_same_as_eager, run_world

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

N, K, BATCH = 4, 2, 8
P01 = graphc.placement("cpu", [0, 1])
P23 = graphc.placement("cpu", [2, 3])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Train(graphc.Graph):
    def __init__(self, model, accumulation, stages=()):
        super().__init__()
        self.model = model
        for name, stage, where in stages:
            getattr(self.model, name).config.set_stage(stage, where)
        opt = torch.optim.Adam(model.parameters(), lr=0.02)
        self.add_optimizer(opt, lr_sch=torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7))
        self.config.set_gradient_accumulation_steps(accumulation)

    def build(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def batch(step):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)


def make(layout, rank, seed=0):
    """(graph, feed) of one layout; `seed` initialises the weights (a resumed graph's are
    replaced by the checkpoint's)."""
    torch.manual_seed(seed)
    model = Net()
    if layout == "pp2xdp2":
        k = rank % 2  # this rank's rows of the data-parallel batch
        return Train(model, 2, [("fc1", 0, P01), ("fc2", 1, P23)]), lambda x, y: (
            graphc.to_global(x.chunk(2)[k], placement=P01, sbp=sbp.split(0)),
            graphc.to_global(y.chunk(2)[k], placement=P23, sbp=sbp.split(0)))
    if layout == "pp2":
        return Train(model, 2, [("fc1", 0, graphc.placement("cpu", [0])),
                                ("fc2", 1, graphc.placement("cpu", [1]))]), lambda x, y: (x, y)
    if layout == "tp2":
        graphc.to_global(model, placement=P01, sbp=sbp.broadcast)
        for p in (model.fc1.weight, model.fc1.bias, model.fc2.weight, model.fc2.bias):
            graphc.to_global(p, placement=P01, sbp=sbp.split(0))
        return Train(model, 1), lambda x, y: (x, y)
    assert layout == "single"
    return Train(model, 1), lambda x, y: (x, y)


def steps(graph, feed, first, last):
    losses = []
    for step in range(first, last):
        loss = graph(*feed(*batch(step))).to_local()
        if loss.numel():
            losses.append(loss.item())
    return losses


def load(graph, feed, checkpoint, first):
    graph.compile(*feed(*batch(first)))     # the layout's state dict, to fill
    sd = graph.state_dict()
    dcp.load(sd, checkpoint_id=checkpoint)
    graph.load_state_dict(sd)


def _pp2xdp2(rank, world, a):
    graph, feed = make("pp2xdp2", rank)
    first = steps(graph, feed, 0, K)
    dcp.save(graph.state_dict(), checkpoint_id=a)
    rest = steps(graph, feed, K, N)
    unbroken = graph.full_state_dict()
    resumed, feed = make("pp2xdp2", rank, seed=1)
    load(resumed, feed, a, K)
    again = steps(resumed, feed, K, N)
    return {"losses": first + rest, "again": again, "state": unbroken,
            "resumed": resumed.full_state_dict(), "steps": resumed.state_dict()["steps"]}


def _resume(rank, world, layout, a, b):
    graph, feed = make(layout, rank, seed=1)
    load(graph, feed, a, K)
    losses = steps(graph, feed, K, K + 1)
    if b is not None:
        dcp.save(graph.state_dict(), checkpoint_id=b)
    losses += steps(graph, feed, K + 1, N)
    return {"losses": losses, "state": graph.full_state_dict()}


def eager(steps_):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    losses = []
    for step in range(steps_):
        x, y = batch(step)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def checkpoints():
    with tempfile.TemporaryDirectory() as d:
        a, b = os.path.join(d, "a"), os.path.join(d, "b")
        saved = run_world(_pp2xdp2, 4, a)
        yield {"a": a, "b": b, "saved": saved}


def _last_stage_losses(results):
    return next(r["losses"] for r in reversed(results) if r["losses"])


def test_pipeline_x_data_parallel_trains_like_eager_and_resumes_bit_for_bit(checkpoints):
    ref_losses, ref_state = eager(N)
    saved = checkpoints["saved"]
    for rank, got in enumerate(saved):
        assert_same_as_eager(got["losses"] if rank >= 2 else [], got["state"],
                             ref_losses if rank >= 2 else [], ref_state, f"pp2xdp2 rank {rank}")
        assert got["steps"] == N
        for k, v in got["state"].items():   # same layout: exactly the unbroken run's numbers
            assert torch.equal(got["resumed"][k], v), f"rank {rank}: {k} differs after dcp resume"
    assert saved[2]["again"] == saved[2]["losses"][K:], "resumed losses differ from the unbroken run's"


@pytest.mark.parametrize("layout", ["pp2", "tp2"])
def test_a_pipeline_x_data_checkpoint_resumes_in_another_layout(checkpoints, layout):
    ref_losses, ref_state = eager(N)
    b = checkpoints["b"] if layout == "tp2" else None
    results = run_world(_resume, 2, layout, checkpoints["a"], b)
    assert_same_as_eager(_last_stage_losses(results), results[0]["state"], ref_losses[K:],
                         ref_state, f"{layout} resumed from pipeline x data")
    assert_same_as_eager([], results[1]["state"], [], ref_state, f"{layout} rank 1")
    if layout == "tp2":  # one process resumes from the tensor-parallel run's shards
        graph, feed = make("single", 0, seed=1)
        load(graph, feed, b, K + 1)
        losses = steps(graph, feed, K + 1, N)
        assert_same_as_eager(losses, graph.full_state_dict(), ref_losses[K + 1:], ref_state,
                             "one process resumed from tensor-parallel shards")


def test_dcp_to_torch_save_loads_into_the_eager_model_strictly(checkpoints, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = str(tmp_path / "whole.pt")
    dcp_to_torch_save(checkpoints["a"], out)
    whole = torch.load(out, weights_only=False)
    model = Net()
    model.load_state_dict(whole["model"], strict=True)
    _, ref_state = eager(K)
    for k, v in model.state_dict().items():
        assert_close(v, ref_state[k], f"dcp_to_torch_save: {k}")
    assert whole["steps"] == K
    assert set(whole["optim"]["state"]) == set(ref_state), "optimizer state keyed by parameter name"


def _save_on_two(rank, world, c):
    graph, feed = make("pp2", rank)
    losses = steps(graph, feed, 0, K)
    rng = torch.get_rng_state()
    dcp.save(graph.state_dict(), checkpoint_id=c)
    return {"losses": losses, "rng": rng, "base_seed": graph.state_dict()["rng"]["base_seed"]}


def _load_on_four(rank, world, c):
    graph, feed = make("pp2xdp2", rank, seed=1)
    load(graph, feed, c, K)
    rng = torch.get_rng_state()
    losses = steps(graph, feed, K, N)
    return {"losses": losses, "rng": rng, "state": graph.full_state_dict()}


@pytest.mark.slow   # CI time: resharding checkpoints also in tests/zero (data 2 -> 1 process, pipeline)
def test_a_checkpoint_of_two_ranks_resumes_on_four(tmp_path):
    """pipeline 2 (2 ranks) saves after K steps; pipeline 2 x data 2 (4 ranks) loads it and
    trains to N at eager's numbers. dcp.load used to fail with 'Missing key ... rng.rank2'.
    Ranks 0 and 1 get the saved RNG states of ranks 0 and 1; ranks 2 and 3, which the saved
    run did not have, get the documented fresh state (See NOTE: RNG states in checkpoints)."""
    c = str(tmp_path / "c")
    saved = run_world(_save_on_two, 2, c)
    resumed = run_world(_load_on_four, 4, c)
    ref_losses, ref_state = eager(N)
    assert_same_as_eager(saved[1]["losses"], {}, ref_losses[:K], {}, "pp2 before saving")
    for rank, got in enumerate(resumed):
        assert_same_as_eager(got["losses"] if rank >= 2 else [], got["state"],
                             ref_losses[K:] if rank >= 2 else [], ref_state, f"pp2xdp2 rank {rank} resumed")
    base_seed = saved[0]["base_seed"]
    for rank in (0, 1):
        assert torch.equal(resumed[rank]["rng"], saved[rank]["rng"]), f"rank {rank}: not its saved RNG state"
    for rank in (2, 3):
        fresh = torch.Generator().manual_seed((base_seed + rank) % 2 ** 64).get_state()
        assert torch.equal(resumed[rank]["rng"], fresh), f"rank {rank}: not the documented fresh state"
