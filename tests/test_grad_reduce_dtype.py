"""config.set_grad_reduce_dtype: data-parallel gradient buckets summed in bfloat16.

The plan lists each bucket's gradients in the reduce dtype and counts its bytes in it; on
two real gloo ranks the reduced gradient is the eager reference's, bit for bit (see
test_bf16_reduce_on_two_ranks_equals_eager_cast_addends).
"""
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import compiler
from graphc.plan.instructions import AllReduce
from helpers import run_world

pytestmark = pytest.mark.fp32
M, B = 2, 8       # micro-batches, global batch: every loss scale is a power of two


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.norm, self.l2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 5)

    def forward(self, x):
        return self.l2(F.gelu(self.norm(self.l1(x))))


class DataParallel(graphc.Graph):
    """No optimizer: the step's reduced gradients stay in .grad to be compared."""

    def __init__(self, model, reduce_dtype=None, amp=False):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(M)
        if amp:
            self.config.enable_amp(True, dtype=torch.bfloat16)
        if reduce_dtype is not None:
            self.config.set_grad_reduce_dtype(reduce_dtype)

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, 16, generator=g), torch.randint(0, 5, (B,), generator=g)


def _model(world):
    torch.manual_seed(0)
    where = graphc.placement("cpu", list(range(world)))
    return graphc.to_global(MLP(), placement=where, sbp=graphc.sbp.broadcast), where


def _plans(reduce_dtype):
    model, where = _model(2)
    x, y = _batch()
    inputs = [(where, graphc.sbp.split(0))] * 2
    return compiler.compile(DataParallel(model, reduce_dtype), [x[:B // 2], y[:B // 2]], 2, inputs).plans


def _buckets(plan):
    """The gradient buckets (not a conversion's all_reduce, which names its node, nor the
    loss's sum once a step, an output's)."""
    return [d for d in plan.to_json()["instructions"]
            if d["op"] == "all_reduce" and "node" not in d and d.get("purpose") != "output"]


def test_plan_lists_buckets_in_the_reduce_dtype_with_half_the_bytes():
    fp32, bf16 = _plans(None), _plans(torch.bfloat16)
    for a, b in zip(fp32, bf16):
        wide, narrow = _buckets(a), _buckets(b)
        assert wide and {t["dtype"] for d in wide for t in d["tensors"]} == {"float32"}
        assert {t["dtype"] for d in narrow for t in d["tensors"]} == {"bfloat16"}
        assert sum(d["bytes"] for d in narrow) * 2 == sum(d["bytes"] for d in wide)
        assert "ALL_REDUCE ranks=[0, 1] [" in str(b) and "weight:bf16[" in str(b)
        json.dumps(b.to_json())


def test_float32_is_the_default_and_other_dtypes_are_refused():
    assert str(_plans(torch.float32)[0]) == str(_plans(None)[0])
    with pytest.raises(graphc.GraphcError, match="set_grad_reduce_dtype"):
        graphc.Graph().config.set_grad_reduce_dtype(torch.int8)


def _addends(model, x, y, rank, world, amp):
    """Rank `rank`'s addend of the averaged gradient, computed eagerly: its rows (a split(0)
    input's local component), cut into M micro-batches, each loss summed over its rows and
    divided by the whole micro-batch's size, backward of loss / M, float32 gradients
    accumulated in micro-batch order."""
    rows = B // world
    for xs, ys in zip(x[rank * rows:(rank + 1) * rows].chunk(M), y[rank * rows:(rank + 1) * rows].chunk(M)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(xs), ys, reduction="sum") / (B // M)
        (loss / M).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _run(rank, world, amp):
    x, y = _batch()
    reference, _ = _model(1)
    addends = [_addends(reference, x, y, r, world, amp) for r in range(world)]
    model, where = _model(world)
    graph = DataParallel(model, torch.bfloat16, amp)
    rows = B // world
    graph(*(graphc.to_global(t[rank * rows:(rank + 1) * rows], placement=where, sbp=graphc.sbp.split(0))
            for t in (x, y)))
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    dtypes = {t.dtype for ins in graph.plan.instructions if type(ins) is AllReduce for t in ins.tensors}
    return grads, addends, dtypes


@pytest.mark.world
@pytest.mark.parametrize("amp", [pytest.param(False, marks=pytest.mark.slow), True],   # CI time: one case
                         ids=["fp32", "amp_bf16"])
def test_bf16_reduce_on_two_ranks_equals_eager_cast_addends(amp):
    """Each rank's addend g_r is its float32 gradient of its rows (every scale a power of two,
    so it is eager's g_r bit for bit, autocast's bf16 matmuls included); gloo sums the
    bf16 casts, (bf16(g_0) + bf16(g_1)) rounded once to bf16 (exact for two addends: a
    commutative sum), and graphc widens it to float32. The eager reference does the same
    cast and sum in torch: equal bit for bit. Against the float32 sum the error is at most
    one bf16 rounding of each addend and of the sum: |err| <= 2**-8 (|g_0| + |g_1|) + 2**-9 |sum|."""
    results = run_world(_run, 2, amp)
    for grads, addends, dtypes in results:
        assert dtypes == {"bfloat16"}
        for k, got in grads.items():
            want = (addends[0][k].bfloat16() + addends[1][k].bfloat16()).float()
            assert got.dtype == torch.float32
            assert torch.equal(got, want), k
            exact = addends[0][k] + addends[1][k]
            assert not torch.equal(got, exact) or got.numel() < 8, k  # the cast did round


class Zero(DataParallel):
    def __init__(self, model, zero: bool):
        super().__init__(model, torch.bfloat16, amp=True)
        if zero:
            self.config.enable_zero(True, stage=2, shard_min_size=1)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_zero_reduce_scatters_in_the_reduce_dtype(monkeypatch):
    """With ZeRO the sharded gradients are reduce-scattered in bf16 (and the parameters
    all-gathered in their float32): two ranks' sum bf16(g0) + bf16(g1) is the all-reduce's
    too, so the parameters equal the replicated run's bit for bit."""
    import graphc.testing
    from graphc.plan.instructions import AllGather, ReduceScatter
    from graphc.runtime.local_world import LocalRank
    moved = []
    scatter = LocalRank.reduce_scatter

    def spy(self, out, parts, *args, **kwargs):
        moved.append(out.dtype)
        return scatter(self, out, parts, *args, **kwargs)

    monkeypatch.setattr(LocalRank, "reduce_scatter", spy)
    x, y = _batch()

    def run(zero):
        def make():
            model, _ = _model(2)
            return Zero(model, zero)

        def inputs(rank, step):
            rows = B // 2
            where = graphc.placement("cpu", [0, 1])
            return tuple(graphc.to_global(t[rank * rows:(rank + 1) * rows], placement=where,
                                          sbp=graphc.sbp.split(0)) for t in (x, y))
        return graphc.testing.local_world(make, inputs, 2, steps=2)

    zero, replicated = run(True), run(False)
    plan = zero.graphs[0].plan.instructions
    assert {t.dtype for i in plan if isinstance(i, ReduceScatter) for t in i.tensors} == {"bfloat16"}
    assert {t.dtype for i in plan if isinstance(i, AllGather) for t in i.tensors} == {"float32"}
    assert moved and set(moved) == {torch.bfloat16}
    for k, v in replicated.state.items():
        assert torch.equal(zero.state[k], v), k
