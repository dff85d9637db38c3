"""ZeRO's memory and traffic (See NOTE: ZeRO in graphc/runtime/zero.py).

On 2 real gloo ranks, the optimizer state (Adam's exp_avg and exp_avg_sq) per rank at stages
1 and 2 is 1/d of the replicated run's within 2% (the biases below shard_min_size stay
whole); stage 1 keeps its packed gradient buckets between steps, stage 2 none. In one
process, the plan's bytes sent per step (graphc/plan/traffic.py) at stages 1 and 2 equal
data parallel's exactly when every sharded dim divides by d, and the plan lists every
REDUCE_SCATTER and ALL_GATHER with its bytes and prints and parses back.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc.compiler import compile as compile_graph
from graphc.plan.plan import ExecutionPlan
from graphc.plan.traffic import step_bytes
from helpers import run_world

D_IN, HIDDEN, CLASSES, BATCH = 32, 128, 4, 16


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(D_IN, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, CLASSES * 8)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))[:, :CLASSES]


class Graph(graphc.Graph):
    def __init__(self, model, opt, zero, accumulation=2):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(accumulation)
        if zero:
            self.config.enable_zero(True, stage=zero, shard_min_size=1024)
        if opt is not None:
            self.add_optimizer(opt)

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _inputs(world):
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, D_IN, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def _state_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim())


def _measure(rank, world):
    where = graphc.placement("cpu", list(range(world)))
    out = {}
    for zero in (0, 1, 2):
        torch.manual_seed(0)
        model = graphc.to_global(Wide(), placement=where, sbp=graphc.sbp.broadcast)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        graph = Graph(model, opt, zero)
        x, y = _inputs(world)
        n = BATCH // world
        for _ in range(2):
            graph(graphc.to_global(x[rank * n:(rank + 1) * n], placement=where, sbp=graphc.sbp.split(0)),
                  graphc.to_global(y[rank * n:(rank + 1) * n], placement=where, sbp=graphc.sbp.split(0)))
        sync = graph._runtime.grad_sync
        try:
            graph.state_dict()
            refused = None
        except graphc.GraphcError as exc:
            refused = str(exc)
        out[zero] = {"optimizer": _state_bytes(opt), "state_dict_refused": refused,
                     "kept_buckets": sum(t.numel() * t.element_size() for t in getattr(sync, "packed", {}).values())}
    return out


@pytest.mark.world
def test_optimizer_state_per_rank_is_one_over_d():
    for rank, res in enumerate(run_world(_measure, 2)):
        full = res[0]["optimizer"]
        assert full == 2 * 8 * sum(p.numel() for p in Wide().parameters())   # Adam: 2 fp64 per element
        for zero in (1, 2):
            ratio = res[zero]["optimizer"] / full
            assert abs(ratio - 0.5) <= 0.5 * 0.02, (rank, zero, ratio)
        weights = sum(p.numel() for n, p in Wide().named_parameters() if p.numel() >= 1024) * 8
        assert res[1]["kept_buckets"] == weights and res[2]["kept_buckets"] == 0
        # a DCP state dict of ZeRO's shards (tests/zero/test_zero_dcp.py checks its numbers)
        assert res[0]["state_dict_refused"] is None and res[2]["state_dict_refused"] is None


def _plans(zero, world):
    where = graphc.placement("cpu", list(range(world)))
    model = graphc.to_global(Wide(), placement=where, sbp=graphc.sbp.broadcast)
    x, y = _inputs(world)
    return compile_graph(Graph(model, None, zero), [x, y], world,
                         [(where, (graphc.sbp.split(0),))] * 2).plans


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_step_equal_data_parallel(world):
    dp = [step_bytes(p) for p in _plans(0, world)]
    for zero in (1, 2):
        plans = _plans(zero, world)
        for plan, base in zip(plans, dp):
            got, base = step_bytes(plan), dict(base)
            assert got.pop("REDUCE_SCATTER") == got.pop("ALL_GATHER") > 0
            grads = step_bytes(plan)["REDUCE_SCATTER"] + step_bytes(plan)["ALL_GATHER"] + got.pop("ALL_REDUCE")
            assert grads == base.pop("ALL_REDUCE")
            assert got == base          # the rest (the loss's all-reduce) alike
            assert ExecutionPlan.parse(str(plan)) == plan
            assert ExecutionPlan.from_json(plan.to_json()) == plan
            assert f"zero: stage {zero};" in str(plan)
