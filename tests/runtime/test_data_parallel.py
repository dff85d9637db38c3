"""Data parallelism from SBP on real gloo processes equals eager PyTorch on the whole batch.

Inputs are split(0) GlobalTensors (each rank passes its rows), the model is broadcast, so
every parameter's gradient is partial_sum and gets all-reduced; tolerance 1e-5 (helpers).
"""
import os
import sys

import pytest
import torch
import torch.nn as nn

import graphc
from graphc.plan.instructions import AllReduce
from helpers import ATOL, RTOL, assert_same_as_eager, eager_train, feed_split, graphc_train, run_world
from models import OPTIMIZERS, make_batches, make_sched

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

STEPS = 3
# (accumulation, optimizer, gradient bucket bytes, model)
CONFIGS = [(1, "sgd_momentum", None, "mlp"), (2, "adam", None, "mlp"),
           (4, "sgd_momentum", 600, "mlp"), (2, "adam", None, "fallback")]


class MLP(nn.Module):
    def __init__(self, d: int = 16, classes: int = 5):
        super().__init__()
        self.l1 = nn.Linear(d, 32)
        self.norm = nn.LayerNorm(32)
        self.act = nn.GELU()
        self.l2 = nn.Linear(32, classes)

    def forward(self, x):
        return self.l2(self.act(self.norm(self.l1(x))))


class FallbackMLP(MLP):
    """logcumsumexp has no SBP rule: its input is gathered, and l2 runs replicated after it."""

    def forward(self, x):
        return self.l2(torch.logcumsumexp(self.act(self.norm(self.l1(x))), 1) / 8)


MODELS = {"mlp": MLP, "fallback": FallbackMLP}
# parameters whose gradient is partial_sum (so all-reduced): all but those after the fallback
SYNCED = {"mlp": ("l1.", "norm.", "l2."), "fallback": ("l1.", "norm.")}


class DataParallelGraph(graphc.Graph):
    def __init__(self, model, opt, sched, accumulation, bucket_bytes):
        super().__init__()
        self.model = model
        self.loss_fn = nn.CrossEntropyLoss()
        self.config.set_gradient_accumulation_steps(accumulation)
        if bucket_bytes:
            self.config.set_gradient_bucket_size(bucket_bytes)
        self.add_optimizer(opt, sched)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def shard(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def _train(rank, world):
    where = graphc.placement("cpu", list(range(world)))
    out = {}
    for acc, opt_name, bucket, kind in CONFIGS:
        torch.manual_seed(0)
        model = graphc.to_global(MODELS[kind](), placement=where, sbp=graphc.sbp.broadcast)
        opt = OPTIMIZERS[opt_name](model.parameters())
        graph = DataParallelGraph(model, opt, make_sched(opt), acc, bucket)
        losses, state = graphc_train(graph, make_batches(STEPS), feed=feed_split(where, rank))
        syncs = [ins for ins in graph.plan.instructions if type(ins) is AllReduce]
        out[(acc, opt_name, bucket, kind)] = {
            "losses": losses, "state": state,
            "synced": sorted(t.name for ins in syncs for t in ins.tensors),
            "buckets": len(syncs), "groups": {ins.ranks for ins in syncs},
            "plan": str(graph.plan), "early": graph._runtime.grad_sync.early}
    out["no_optimizer_grad"] = _grads_without_optimizer(rank, world, where)
    if world == 2:
        import ddp
        out["ddp_example_w"] = ddp.main(iters=300)
    return out


class NoOptimizerGraph(graphc.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(2)

    def build(self, x, y):
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _grads_without_optimizer(rank, world, where):
    """Two steps, nothing zeroes the gradients: they accumulate as in eager, each step's
    partial sums reduced once."""
    torch.manual_seed(0)
    model = graphc.to_global(MLP(), placement=where, sbp=graphc.sbp.broadcast)
    graph = NoOptimizerGraph(model)
    for x, y in make_batches(2):
        graph(graphc.to_global(shard(x, rank, world), placement=where, sbp=graphc.sbp.split(0)),
              graphc.to_global(shard(y, rank, world), placement=where, sbp=graphc.sbp.split(0)))
    return model.l1.weight.grad.clone()


# CI time: -m slow; data 2 runs in the local world (tests/local/test_local_world.py), held bitwise
# to gloo (test_local_vs_gloo), and on gloo in tests/test_semantics_gloo.py
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_data_parallel_matches_eager(world):
    results = run_world(_train, world)
    batches = make_batches(STEPS)
    for acc, opt_name, bucket, kind in CONFIGS:
        torch.manual_seed(0)
        ref_losses, ref_state = eager_train(MODELS[kind](), OPTIMIZERS[opt_name], make_sched,
                                            nn.CrossEntropyLoss(), batches, STEPS)
        for rank, res in enumerate(results):
            got = res[(acc, opt_name, bucket, kind)]
            what = f"world={world} {kind} acc={acc} {opt_name} bucket={bucket} rank {rank}"
            assert_same_as_eager(got["losses"], got["state"], ref_losses, ref_state, what)
            # exactly the partial_sum gradients are all-reduced, once, over the placement
            assert got["synced"] == sorted(f"model.{k}" for k in ref_state
                                           if k.startswith(SYNCED[kind])), what
            assert got["groups"] == {tuple(range(world))}, what
            if kind == "fallback":
                assert "fallback: logcumsumexp" in got["plan"], what
            if bucket:  # 600 bytes: l1.weight (2 KiB) and the rest cannot share one bucket
                assert got["buckets"] > 1, what
            # every bucket started during the last backward (hooks), overlapping it
            assert got["early"] == got["buckets"], what
    torch.manual_seed(0)
    ref = MLP()
    for x, y in batches[:2]:
        nn.functional.cross_entropy(ref(x), y).backward()
    for res in results:
        torch.testing.assert_close(res["no_optimizer_grad"], ref.l1.weight.grad, atol=ATOL, rtol=RTOL)
    if world == 2:
        for res in results:  # seed 001: w converges to [2, 3]
            torch.testing.assert_close(res["ddp_example_w"], torch.tensor([[2.0], [3.0]], dtype=res["ddp_example_w"].dtype),
                                       atol=1e-3, rtol=0)
