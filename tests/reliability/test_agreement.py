"""Ranks agree before the first step, or every rank raises the same GraphcError (real gloo).

See NOTE: Rank agreement (graphc/runtime/agreement.py). Each case runs on 2 spawned ranks;
each rank returns the message it raised, so the test also shows that no rank hangs.
"""
import os

import pytest
import torch
import torch.nn as nn

import graphc
from graphc import sbp
from helpers import run_world
from models import PipelineGraph, SkipNet

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)


class DataParallel(graphc.Graph):
    def __init__(self, model, acc=1):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(acc)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, x, y):
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def _dp_inputs(rank, rows=4):
    p = graphc.placement("cpu", ranks=[0, 1])
    return (graphc.to_global(torch.randn(rows, 3), placement=p, sbp=sbp.split(0)),
            graphc.to_global(torch.randn(rows, 2), placement=p, sbp=sbp.split(0)))


def _message(fn):
    try:
        fn()
    except graphc.GraphcError as e:
        return str(e)
    return None


def _cases(rank, world):
    out = {}
    # 1. other input shapes on one rank (a pipeline: rank 1 gets a bigger batch)
    model = SkipNet(world)
    g = PipelineGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation=2)
    rows = 8 if rank == 0 else 12
    out["shapes"] = _message(lambda: g(torch.randn(rows, 16), torch.randint(0, 5, (rows,))))
    # 2. other accumulation steps on one rank
    torch.manual_seed(0)
    g = DataParallel(nn.Linear(3, 2), acc=1 + rank)
    out["accumulation"] = _message(lambda: g(*_dp_inputs(rank)))
    # 3. data parallel replicas built with different seeds
    torch.manual_seed(rank)
    g = DataParallel(nn.Linear(3, 2))
    out["replicas"] = _message(lambda: g(*_dp_inputs(rank)))
    # 4. a graph called on rank 0 only
    os.environ["GRAPHC_TIMEOUT"] = "3"
    torch.manual_seed(0)
    g = DataParallel(nn.Linear(3, 2))
    out["one rank"] = _message(lambda: g(*_dp_inputs(rank))) if rank == 0 else None
    os.environ["GRAPHC_TIMEOUT"] = "60"
    # 5. a checkpoint set whose ranks were saved at different steps
    torch.manual_seed(0)
    g = DataParallel(nn.Linear(3, 2))
    g(*_dp_inputs(rank))
    first = g.state_dict()
    g(*_dp_inputs(rank))
    second = g.state_dict()
    torch.manual_seed(0)
    g = DataParallel(nn.Linear(3, 2))
    g.load_state_dict(first if rank == 0 else second)
    out["checkpoint"] = _message(lambda: g(*_dp_inputs(rank)))
    # 6. the same program everywhere: no error, and the next exchange still pairs up
    torch.manual_seed(0)
    g = DataParallel(nn.Linear(3, 2))
    out["agree"] = _message(lambda: g(*_dp_inputs(rank)))
    return out


def test_ranks_that_disagree_stop_with_the_same_error():
    results = run_world(_cases, 2, timeout=240)
    for case in ("shapes", "accumulation", "replicas", "checkpoint"):
        msgs = [r[case] for r in results]
        assert all(m is not None for m in msgs), f"{case}: some rank did not raise: {msgs}"
        assert all("the ranks disagree" in m for m in msgs), msgs
    assert "input shapes" in results[0]["shapes"] and "ranks [0]" in results[0]["shapes"]
    assert "gradient accumulation steps" in results[1]["accumulation"]
    assert "replicated parameter 'model.weight'" in results[0]["replicas"], results[0]["replicas"]
    assert "torch.manual_seed" in results[0]["replicas"]
    assert "rank(s) [1] did not reach" in results[0]["one rank"], results[0]["one rank"]
    assert all("checkpoint step" in r["checkpoint"] for r in results), results[0]["checkpoint"]
    assert results[0]["agree"] is None and results[1]["agree"] is None


def _first_call_on_one_rank(rank, world, caller):
    """The graph's first call, which also sets up the process group, on rank `caller` only."""
    os.environ["GRAPHC_TIMEOUT"] = "3"
    torch.manual_seed(0)
    g = DataParallel(nn.Linear(3, 2))
    return _message(lambda: g(*_dp_inputs(rank))) if rank == caller else None


@pytest.mark.parametrize("caller", [0, pytest.param(1, marks=pytest.mark.slow)])   # CI time: one caller shows the naming
def test_a_first_call_on_one_rank_names_the_ranks_that_never_called(caller):
    """`if rank == caller: graph(x)` before any process group exists: torch's own set-up
    waited out the timeout and raised DistStoreError ('1/2 clients joined'); now the caller
    raises a GraphcError naming the absent rank (rank 0 hosts the store, so a caller that
    is not rank 0 finds no store at all)."""
    results = run_world(_first_call_on_one_rank, 2, caller, timeout=120)
    message = results[caller]
    assert message is not None, "the rank that called the graph did not raise"
    if caller == 0:
        assert "rank(s) [1] did not reach the first call of a graph" in message, message
    else:
        assert "the store at 127.0.0.1:" in message and "which rank 0 hosts, did not answer" in message, message
    assert "GRAPHC_TIMEOUT (3 s)" in message and "call the graph on every rank" in message, message
