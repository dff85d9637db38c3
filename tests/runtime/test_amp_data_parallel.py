"""enable_amp on data parallel (2 gloo ranks, CPU autocast to bfloat16) against eager autocast.

NOTE: Data parallel under autocast
Rank r runs eager's ops on its rows of each micro-batch, so every row's activations and
activation gradients are eager's, bit for bit (CPU bf16 kernels compute a row alone). What
differs is where a parameter gradient's sum over rows is cut and rounded: eager's bf16
matmul backward sums all n rows of a micro-batch in float32 and rounds once to bf16,

    e = bf16(sum_i c_i),

while rank r rounds its own rows' sum, a_r = bf16(sum_{i in r} c_i), and the all-reduce adds
the float32 a_0 + a_1 (then the float32 accumulation over micro-batches, alike in both). With
u = 2**-8 (bf16's unit roundoff) and gamma = n 2**-24 (a float32 sum of n terms in any
order), both are within u |rounded| / (1 - u) + gamma A of the exact sum S = sum_i c_i
(A = sum_i |c_i|), so per micro-batch

    |a_0 + a_1 - e| <= (u / (1 - u)) (|a_0| + |a_1| + |e|) + 2 gamma A + 2**-24 |a_0 + a_1|,

summed over the micro-batches (plus 2**-24 of each side for their float32 accumulation).
A is |dY|^T |X| (a weight) or sum_i |dY_i| (a bias) of the bf16 operands, taken from eager.
Two checks follow: graphc equals eager run on each rank's rows and summed in float32 bit for
bit over AdamW steps (so this is the only difference), and one step's gradients are within
the bound of eager on the whole batch.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from helpers import run_world

pytestmark = [pytest.mark.world, pytest.mark.fp32]
M, B, STEPS, WORLD = 2, 16, 3, 2      # micro-batches, batch, steps: every loss scale a power of 2
U, F32 = 2.0 ** -8, 2.0 ** -24


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 5)

    def forward(self, x):
        return self.l2(F.gelu(self.l1(x)))


class DataParallel(graphc.Graph):
    def __init__(self, model, opt=None):
        super().__init__()
        self.model = model
        self.config.enable_amp(True, dtype=torch.bfloat16)
        self.config.set_gradient_accumulation_steps(M)
        if opt is not None:
            self.add_optimizer(opt)

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(B, 16, generator=g), torch.randint(0, 5, (B,), generator=g)) for _ in range(STEPS)]


def _model():
    torch.manual_seed(0)
    return MLP()


def _pieces(x, y):
    """The micro-batches of each rank, as graphc cuts them: rank r's rows (its split(0)
    component), then M micro-batches of those."""
    rows = B // WORLD
    return [list(zip(x[r * rows:(r + 1) * rows].chunk(M), y[r * rows:(r + 1) * rows].chunk(M)))
            for r in range(WORLD)]


def _backward(model, xs, ys):
    """One micro-batch's autocast forward and backward of its share of the batch-mean loss."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(xs), ys, reduction="sum") / (B // M)
    (loss / M).backward()


def _grads(model):
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _eager_on_rank_rows(model):
    """Eager autocast and AdamW, each step's gradient the float32 sum of the ranks' addends
    (each rank's micro-batches accumulated in order), as graphc's all-reduce adds them."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in _batches():
        addends = []
        for pieces in _pieces(x, y):
            for xs, ys in pieces:
                _backward(model, xs, ys)
            addends.append(_grads(model))
        for k, p in model.named_parameters():
            p.grad = addends[0][k] + addends[1][k]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _one_step_terms(model):
    """The first batch's pieces of the bound: per micro-batch, the ranks' addends, eager's
    whole-micro-batch gradient and A (from the bf16 operands eager's Linear layers saw)."""
    x, y = _batches()[0]
    pieces = _pieces(x, y)
    terms = []
    for m in range(M):
        addends = []
        for r in range(WORLD):
            _backward(model, *pieces[r][m])
            addends.append(_grads(model))
        xs = torch.cat([pieces[r][m][0] for r in range(WORLD)])
        ys = torch.cat([pieces[r][m][1] for r in range(WORLD)])
        seen, hooks = {}, []
        for name in ("l1", "l2"):
            mod = getattr(model, name)
            hooks.append(mod.register_forward_hook(lambda mod, i, o, name=name: seen.__setitem__(name, i[0])))
            hooks.append(mod.register_full_backward_hook(
                lambda mod, gi, go, name=name: seen.__setitem__(name + ".dy", go[0])))
        _backward(model, xs, ys)
        for h in hooks:
            h.remove()
        whole = _grads(model)
        size = {}
        for name in ("l1", "l2"):
            dy = seen[name + ".dy"].double().abs()
            size[name + ".weight"] = dy.T @ seen[name].bfloat16().double().abs()
            size[name + ".bias"] = dy.sum(0)
        terms.append((addends, whole, size))
    return terms


def _run(rank, world):
    x_all = _batches()
    reference = _eager_on_rank_rows(_model())
    terms = _one_step_terms(_model())
    where = graphc.placement("cpu", list(range(world)))
    rows = B // world

    def local(t):
        return graphc.to_global(t[rank * rows:(rank + 1) * rows], placement=where, sbp=graphc.sbp.split(0))

    model = graphc.to_global(_model(), placement=where, sbp=graphc.sbp.broadcast)
    graph = DataParallel(model)                 # no optimizer: one step's gradients stay
    graph(local(x_all[0][0]), local(x_all[0][1]))
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}

    model = graphc.to_global(_model(), placement=where, sbp=graphc.sbp.broadcast)
    graph = DataParallel(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for x, y in x_all:
        graph(local(x), local(y))
    return grads, {k: v.clone() for k, v in graph.full_state_dict().items()}, reference, terms


@pytest.fixture(scope="module")
def results():
    # module-scoped, so made before the fp32 mark sets the default dtype: set it here (the
    # ranks take the caller's); float64 parameters would never be cast by autocast
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        return run_world(_run, WORLD)
    finally:
        torch.set_default_dtype(old)


def test_equals_eager_on_each_ranks_rows_bitwise(results):
    for _, state, reference, _ in results:
        for k, v in reference.items():
            assert torch.equal(state[k], v), k


def test_one_step_is_within_the_bound_of_eager_on_the_whole_batch(results):
    grads, _, _, terms = results[0]
    n = B // M                                  # rows of a micro-batch
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
