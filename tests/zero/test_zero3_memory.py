"""ZeRO stage 3's memory and traffic (See NOTE: ZeRO stage 3 in graphc/runtime/zero.py).

On 2 real gloo ranks, between steps each rank holds of every sharded parameter only its rows
(the whole parameter's storage is freed: 0 bytes) and Adam's state for those rows, 1/d of the
replicated run's; the whole parameters and their state are what stays whole (the biases below
shard_min_size). graph.state_dict() and full_state_dict() gather them for the call and leave
them freed. A forward-only graph sharing the model, which does not gather them itself, gathers
them whole for its call (with a warning) and frees them after. In one process, the plan's bytes
per step at stage 3 with one stage per rank (gathered once per step) equal data parallel's.
"""
import warnings

import pytest
import torch

import graphc
from graphc.plan.instructions import AllGather, ReleaseParams
from graphc.plan.traffic import step_bytes
from helpers import run_world
from test_zero_memory import BATCH, Graph, Wide, _inputs, _plans, _state_bytes


class Evaluate(graphc.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def build(self, x):
        return self.model(x)


def _held_bytes(model, opt) -> dict:
    params = list(model.parameters())
    whole = sum(p.untyped_storage().nbytes() for p in params)
    shards = sum(s.untyped_storage().nbytes() for s in getattr(opt, "_graphc_zero_shards", {}).values())
    return {"whole": whole, "shards": shards, "optimizer": _state_bytes(opt),
            "grads": sum(p.grad.numel() for p in params if p.grad is not None)}


def _measure(rank, world):
    where = graphc.placement("cpu", list(range(world)))
    x, y = _inputs(world)
    n = BATCH // world
    xs = graphc.to_global(x[rank * n:(rank + 1) * n], placement=where, sbp=graphc.sbp.split(0))
    ys = graphc.to_global(y[rank * n:(rank + 1) * n], placement=where, sbp=graphc.sbp.split(0))
    out = {}
    for zero in (0, 3):
        torch.manual_seed(0)
        model = graphc.to_global(Wide(), placement=where, sbp=graphc.sbp.broadcast)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        graph = Graph(model, opt, zero)
        graph.config.set_memory_stats(True)   # max_live_bytes is read below
        for _ in range(2):
            graph(xs, ys)
        out[zero] = _held_bytes(model, opt)
        out[zero]["activations"] = dict(graph.last_stats.max_live_bytes)
        if zero:
            out["plan"] = graph.plan
            graph.state_dict()
            full = graph.full_state_dict()
            out["after_state_dicts"] = _held_bytes(model, opt)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                logits = Evaluate(model)(xs).to_local()
            out["eval_warned"] = any("ZeRO stage 3" in str(w.message) for w in caught)
            out["eval_matches"] = (logits - torch.func.functional_call(
                Wide(), full, (x[rank * n:(rank + 1) * n],))).abs().max().item()
            out["after_eval"] = _held_bytes(model, opt)
    return out


@pytest.mark.world
def test_parameters_held_between_steps_are_one_over_d():
    weights = sum(p.numel() for p in Wide().parameters() if p.numel() >= 1024) * 8
    small = sum(p.numel() for p in Wide().parameters() if p.numel() < 1024) * 8
    for rank, res in enumerate(run_world(_measure, 2)):
        assert res[0]["whole"] == weights + small and res[0]["shards"] == 0
        assert res[3]["whole"] == small                        # sharded weights freed
        assert res[3]["shards"] == weights // 2                # every weight's rows divide by 2
        assert res[3]["optimizer"] == 2 * (weights // 2 + small)   # Adam: 2 per element held
        assert res[0]["optimizer"] == 2 * (weights + small)
        assert res[3]["grads"] == res[0]["grads"] == 0         # gradients dropped after the step
        # the stage's peak activation bytes: the same, though each gather gives the parameters new storage
        assert res[3].pop("activations") == res[0].pop("activations")
        assert res["after_state_dicts"] == res[3] and res["after_eval"] == res[3]
        assert res["eval_warned"] == (rank == 0)     # warnings print on rank 0 (GRAPHC_LOG_RANKS)
        assert res["eval_matches"] == 0, res["eval_matches"]
        plan = res["plan"]
        assert "gathered before use and released after, once per step" in str(plan)
        assert sum(isinstance(i, AllGather) for i in plan.instructions) == 1
        assert sum(isinstance(i, ReleaseParams) for i in plan.instructions) == 1


@pytest.mark.parametrize("world", [2, 4])
def test_stage_3_gathered_once_per_step_moves_data_parallels_bytes(world):
    for plan, base in zip(_plans(3, world), (step_bytes(p) for p in _plans(0, world))):
        got, base = step_bytes(plan), dict(base)
        assert got.pop("REDUCE_SCATTER") == got.pop("ALL_GATHER") > 0
        grads = step_bytes(plan)["REDUCE_SCATTER"] + step_bytes(plan)["ALL_GATHER"] + got.pop("ALL_REDUCE")
        assert grads == base.pop("ALL_REDUCE") and got == base
        gather = next(i for i, ins in enumerate(plan.instructions) if isinstance(ins, AllGather))
        release = next(i for i, ins in enumerate(plan.instructions) if isinstance(ins, ReleaseParams))
        computes = [i for i, ins in enumerate(plan.instructions) if type(ins).__name__ in ("Forward", "Backward")]
        between = {type(ins).__name__ for ins in plan.instructions[computes[-1] + 1:release]}
        assert gather == computes[0] - 1 and release > computes[-1] and between <= {"OutputAllReduce"}   # the loss's sum may come first
