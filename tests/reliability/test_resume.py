"""Checkpoints resume exactly, and training is deterministic, on real gloo processes.

A 2-stage SkipNet pipeline with Adam, a StepLR schedule and 2 micro-batches trains
N steps. Resuming (K steps, graphc.save per rank, a fresh process world, graphc.load,
N - K steps) must end bit for bit where the unbroken run ends (torch.equal, no
tolerance), and two unbroken runs with the same seed give bit-identical losses.
"""
import os
import tempfile

import pytest
import torch

import graphc
from helpers import run_world
from models import PipelineGraph, SkipNet

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

N, K = 6, 3


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 16, generator=g), torch.randint(0, 5, (16,), generator=g)


def _new_graph(world, seed=0):
    torch.manual_seed(seed)
    model = SkipNet(world)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return PipelineGraph(model, opt, sched, accumulation=2)


def _train(graph, steps, first=0):
    losses = []
    for step in range(first, first + steps):
        loss = graph(*_batch(step)).to_local()
        losses.append(loss.clone() if loss.numel() else None)
    return losses


def _unbroken_and_saved(rank, world, ckpt_dir):
    """One world: an unbroken N-step run, then a K-step run that saves and stops."""
    unbroken = _new_graph(world)
    losses = _train(unbroken, N)
    final = unbroken.full_state_dict()
    partial = _new_graph(world)
    _train(partial, K)
    graphc.save(partial.state_dict(), os.path.join(ckpt_dir, f"rank{rank}.pt"))
    return {"losses": losses, "final": final}


def _resumed(rank, world, ckpt_dir):
    graph = _new_graph(world, seed=1234)  # different init: everything must come from the file
    graph.load_state_dict(graphc.load(os.path.join(ckpt_dir, f"rank{rank}.pt")))
    losses = _train(graph, N - K, first=K)
    return {"losses": losses, "final": graph.full_state_dict(), "steps": graph.state_dict()["steps"]}


@pytest.fixture(scope="module")
def first_world():
    with tempfile.TemporaryDirectory() as ckpt_dir:
        yield run_world(_unbroken_and_saved, 2, ckpt_dir), ckpt_dir


def test_resume_ends_bit_for_bit_where_the_unbroken_run_ends(first_world):
    results, ckpt_dir = first_world
    resumed = run_world(_resumed, 2, ckpt_dir)
    for rank in range(2):
        assert resumed[rank]["steps"] == N
        ref, got = results[rank]["final"], resumed[rank]["final"]
        assert ref.keys() == got.keys()
        for k in ref:
            assert torch.equal(ref[k], got[k]), f"rank {rank}: {k} differs after resuming"
    # the loss lives on the last stage; the resumed steps' losses are the unbroken run's
    ref_losses, got_losses = results[1]["losses"][K:], resumed[1]["losses"]
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, got_losses)), (ref_losses, got_losses)


def _unbroken(rank, world):
    return _train(_new_graph(world), N)


def test_same_seed_gives_bit_identical_losses(first_world):
    results, _ = first_world
    again = run_world(_unbroken, 2)
    first, second = results[1]["losses"], again[1]
    assert len(first) == N and all(t is not None for t in first)
    assert all(torch.equal(a, b) for a, b in zip(first, second)), (first, second)
    assert len({float(t) for t in first}) > 1  # the losses change step to step: a real run
