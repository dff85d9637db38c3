"""set_param_dtype(bf16) with enable_amp on data parallel (2 gloo ranks) against eager.

Every parameter's gradient reaches its float32 master rounded to bf16 once per micro-batch
and rank: a Linear's by its bf16 matmul, LayerNorm's (computed in float32 under autocast)
by the cast back to its bf16 parameter. So NOTE: Data parallel under autocast
(tests/runtime/test_amp_data_parallel.py) applies to every parameter, LayerNorm's included:
rank r rounds its rows' sum, a_r = bf16(sum_{i in r} c_i), eager on the whole micro-batch
e = bf16(sum_i c_i), and per micro-batch

    |a_0 + a_1 - e| <= (u / (1 - u)) (|a_0| + |a_1| + |e|) + 2 gamma A + 2**-24 |a_0 + a_1|,

u = 2**-8, gamma = n 2**-24, A = sum_i |c_i| over the micro-batch's n rows: |dY|^T |X| for
a weight, sum_i |dY_i| for a bias, sum_i |dY_i * xhat_i| for LayerNorm's weight (xhat its
normalised input). Checked: graphc equals eager with masters on each rank's rows, summed in
float32, bit for bit over AdamW steps (that cut is the only difference), and one step's
master gradients are within the bound of eager with masters on the whole batch.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from helpers import run_world
from test_amp_data_parallel import B, F32, M, U, WORLD, _batches, _pieces   # the same data and cut
from test_amp_data_parallel import DataParallel as AmpDataParallel

pytestmark = [pytest.mark.world, pytest.mark.fp32]


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.norm, self.l2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 5)

    def forward(self, x):
        return self.l2(F.gelu(self.norm(self.l1(x))))


class DataParallel(AmpDataParallel):
    """test_amp_data_parallel's graph with bf16 parameters and float32 masters."""

    def __init__(self, model, opt):
        super().__init__(model, opt)
        self.config.set_param_dtype(torch.bfloat16)


def _model():
    """A bf16 model and its float32 masters (the values it was made with)."""
    torch.manual_seed(0)
    model = MLP()
    masters = {k: p.detach().clone().requires_grad_() for k, p in model.named_parameters()}
    return model.to(torch.bfloat16), masters


def _backward(model, xs, ys):
    """One micro-batch's share of the batch-mean loss, its bf16 gradients returned as float32."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(xs), ys, reduction="sum") / (B // M)
    (loss / M).backward()
    grads = {k: p.grad.float() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _eager_on_rank_rows():
    """Masters stepped by AdamW on the float32 sum of the ranks' addends, each rank's
    micro-batches accumulated in float32 in order; the model their rounding after each step."""
    model, masters = _model()
    opt = torch.optim.AdamW(masters.values(), lr=1e-2)
    for x, y in _batches():
        addends = []
        for pieces in _pieces(x, y):
            acc = {}
            for xs, ys in pieces:
                for k, g in _backward(model, xs, ys).items():
                    acc[k] = g if k not in acc else acc[k].add_(g)
            addends.append(acc)
        for k, m in masters.items():
            m.grad = addends[0][k] + addends[1][k]
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(masters[k])
    return {k: m.detach().clone() for k, m in masters.items()}


def _one_step_terms():
    """Per micro-batch of the first batch: the ranks' addends, eager's whole-micro-batch
    gradient, and A (from the operands eager's layers saw)."""
    model, _ = _model()
    x, y = _batches()[0]
    pieces = _pieces(x, y)
    terms = []
    for m in range(M):
        addends = [_backward(model, *pieces[r][m]) for r in range(WORLD)]
        seen, hooks = {}, []
        for name in ("l1", "norm", "l2"):
            mod = getattr(model, name)
            hooks.append(mod.register_forward_hook(lambda mod, i, o, name=name: seen.__setitem__(name, i[0])))
            hooks.append(mod.register_full_backward_hook(
                lambda mod, gi, go, name=name: seen.__setitem__(name + ".dy", go[0])))
        whole = _backward(model, torch.cat([pieces[r][m][0] for r in range(WORLD)]),
                          torch.cat([pieces[r][m][1] for r in range(WORLD)]))
        for h in hooks:
            h.remove()
        size = {}
        for name in ("l1", "l2"):
            dy = seen[name + ".dy"].double().abs()
            size[name + ".weight"] = dy.T @ seen[name].bfloat16().double().abs()
            size[name + ".bias"] = dy.sum(0)
        h = seen["norm"].double()
        xhat = (h - h.mean(-1, keepdim=True)) / (h.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
        dy = seen["norm.dy"].double().abs()
        size["norm.weight"], size["norm.bias"] = (dy * xhat.abs()).sum(0), dy.sum(0)
        terms.append((addends, whole, size))
    return terms


def _run(rank, world):
    torch.set_num_threads(1)
    reference, terms = _eager_on_rank_rows(), _one_step_terms()
    where = graphc.placement("cpu", list(range(world)))
    rows = B // world

    def local(t):
        return graphc.to_global(t[rank * rows:(rank + 1) * rows], placement=where, sbp=graphc.sbp.split(0))

    torch.manual_seed(0)
    model = graphc.to_global(MLP(), placement=where, sbp=graphc.sbp.broadcast)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    graph = DataParallel(model, opt)
    batches = _batches()
    opt.step = opt.zero_grad = lambda *a, **k: None     # one step's master gradients, kept
    graph(local(batches[0][0]), local(batches[0][1]))
    masters = [p for g in opt.param_groups for p in g["params"]]
    grads = {k: m.grad.clone() for (k, _), m in zip(model.named_parameters(), masters)}

    torch.manual_seed(0)
    model = graphc.to_global(MLP(), placement=where, sbp=graphc.sbp.broadcast)
    graph = DataParallel(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for x, y in batches:
        graph(local(x), local(y))
    return grads, {k: v.clone() for k, v in graph.full_state_dict().items()}, reference, terms


@pytest.fixture(scope="module")
def results():
    old = torch.get_default_dtype()   # module-scoped: before the fp32 mark sets it
    torch.set_default_dtype(torch.float32)
    try:
        return run_world(_run, WORLD)
    finally:
        torch.set_default_dtype(old)


def test_equals_eager_with_masters_on_each_ranks_rows_bitwise(results):
    for _, state, reference, _ in results:
        for k, v in reference.items():
            assert state[k].dtype == torch.float32 and torch.equal(state[k], v), k


def test_one_step_is_within_the_bound_of_eager_with_masters_on_the_whole_batch(results):
    grads, _, _, terms = results[0]
    n = B // M
    for k, got in grads.items():
        want = sum(whole[k] for _, whole, _ in terms)
        bound = sum((U / (1 - U)) * (a[0][k].abs() + a[1][k].abs() + whole[k].abs()).double()
                    + 2 * n * F32 * size[k] + F32 * (a[0][k] + a[1][k]).abs().double()
                    for a, whole, size in terms)
        bound = bound + F32 * (got.abs() + want.abs()).double()
        err = (got - want).double().abs()
        assert got.dtype == torch.float32 and (err <= bound).all(), (k, (err - bound).max())
        if k.endswith("weight"):   # the cut does round: differences of bf16's size
            assert (err > 2 ** -12 * want.abs().double()).any(), k
