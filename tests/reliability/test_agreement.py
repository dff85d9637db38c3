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
