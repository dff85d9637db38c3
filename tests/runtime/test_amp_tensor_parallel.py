"""enable_amp on tensor parallel (2 gloo ranks, CPU autocast to bfloat16): Megatron's pair
(`col` split by rows, `row` by columns) against eager autocast, within a derived bound.

NOTE: Tensor parallel under autocast
Every difference starts at the row-parallel output y = h W^T + b (the logits here): eager's
bf16 matmul sums all K = 32 products in float32 and rounds once to bf16; rank r sums its 16
and rounds to bf16, p_r, and the ranks' partial sums are added across ranks, as Megatron
does (the plan lists that all-reduce in bf16). With u = 2**-8 (bf16's unit roundoff),
u' = u / (1 - u), gamma = K 2**-24 and A = |h|^T |W| (the bf16 operands, from eager),

  |y_tp - y| <= beta = u' (|p_0| + |p_1| + |y| + |p_0 + b| + |y_tp|) + u |b|
                       + 2 gamma (A + |b|) + 2**-23 |y_tp|

(the terms of the partial sums' roundings, of adding the bias to one of them in bf16 or
float32, of eager's bias cast to bf16 and of float32 sums). Before it, h and z are eager's
(each output column of the column-parallel matmul is eager's, bit for bit). After it, each
op adds its own rounding to the difference it receives, bounded to first order:
  loss:  |d CE_i| <= 2 max_j beta_ij (the logit gradient has l1 norm <= 2), / N for the mean;
  g = dloss/dy = (softmax(y) - onehot) / N: |d g_i| <= max_j beta_ij / (2 N) (softmax's
      Jacobian has inf-norm <= 1/2), then rounded to bf16: D_g = dg (1 + 2u') + 2u' |g|;
  row's weight and bias gradients, dh = g W, dz = gelu'(z) dh, col's weight and bias
      gradients: each |op(a) - op(a')| <= |op|(|a - a'|) + u' (|result| + |result'|) +
      2 gamma_n |op|(|a|), the op applied to absolute values.
The test computes each term from eager's intermediate values (float64) and checks every
gradient and the loss against it.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from helpers import run_world

pytestmark = [pytest.mark.world, pytest.mark.fp32]
B, D, H, C, WORLD = 8, 16, 32, 8, 2
U, F32 = 2.0 ** -8, 2.0 ** -24
U1 = U / (1 - U)


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.col, self.row = nn.Linear(D, H), nn.Linear(H, C)

    def forward(self, x):
        return self.row(F.gelu(self.col(x)))


class TensorParallel(graphc.Graph):
    def __init__(self, model):
        super().__init__()
        p = graphc.placement("cpu", list(range(WORLD)))
        self.model = graphc.to_global(model, placement=p, sbp=graphc.sbp.broadcast)
        graphc.to_global(self.model.col, placement=p, sbp=graphc.sbp.split(0))
        graphc.to_global(self.model.row.weight, placement=p, sbp=graphc.sbp.split(1))
        self.config.enable_amp(True, dtype=torch.bfloat16)

    def build(self, x, t):
        loss = F.cross_entropy(self.model(x), t)
        loss.backward()
        return loss


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, D, generator=g), torch.randint(0, C, (B,), generator=g)


def _model():
    torch.manual_seed(0)
    return Pair()


def _eager():
    """Eager autocast's values (float64 copies) and the bound's terms of one step."""
    model = _model()
    x, t = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = model.col(x)
        h = F.gelu(z)
        y = model.row(h)
        parts = [F.linear(h[:, r * H // 2:(r + 1) * H // 2], model.row.weight[:, r * H // 2:(r + 1) * H // 2])
                 for r in range(WORLD)]
        loss = F.cross_entropy(y, t)
    for v in (z, h, y):
        v.retain_grad()
    loss.backward()
    d = lambda v: v.detach().double()
    e = {"loss": d(loss), "z": d(z), "h": d(h), "y": d(y), "dz": d(z.grad), "dh": d(h.grad), "dy": d(y.grad),
         "x": d(x.bfloat16()), "w_row": d(model.row.weight.bfloat16()), "b_row": d(model.row.bias),
         "p": [d(p) for p in parts]}
    e["g"] = (torch.softmax(e["y"], 1) - F.one_hot(t, C).double()) / B
    e.update({f"grad.{k}": d(p.grad) for k, p in model.named_parameters()})
    return e


def _run(rank, world):
    torch.set_default_dtype(torch.float32)
    model = _model()
    graph = TensorParallel(model)
    x, t = _batch()
    loss = graph(x, t).to_local().clone()
    return loss, {k: p.grad.clone() for k, p in model.named_parameters()}, _eager()


def _gelu_slope(z):
    phi = torch.exp(-z * z / 2) / (2 * torch.pi) ** 0.5
    return 0.5 * (1 + torch.erf(z / 2 ** 0.5)) + z * phi


def _within(name, got, want, bound):
    err = (got.double() - want).abs()
    assert got.dtype == torch.float32 and (err <= bound).all(), (name, (err - bound).max())


@pytest.fixture(scope="module")
def results():
    # module-scoped, so made before the fp32 mark sets the default dtype: the ranks set it
    return run_world(_run, WORLD)


@pytest.mark.parametrize("rank", range(WORLD))
def test_one_step_is_within_the_bound_of_eager(results, rank):
    loss, grads, e = results[rank]
    cols = slice(rank * H // 2, (rank + 1) * H // 2)       # this rank's hidden features
    # the logits: partial sums rounded, bias, float32 sums (y_tp <= |y| + beta, solved)
    a = e["h"].abs() @ e["w_row"].abs().T
    b = e["b_row"].abs()
    p0, p1 = e["p"]
    fixed = U1 * (p0.abs() + p1.abs() + e["y"].abs() + (p0 + b).abs()) + U * b + 2 * H * F32 * (a + b)
    beta = (fixed + (U1 + 2 * F32) * e["y"].abs()) / (1 - U1 - 2 * F32)
    worst = beta.max(1, keepdim=True).values                  # per row
    _within("loss", loss, e["loss"], 2 * worst.sum() / B + 2 ** -20 * e["loss"].abs())
    dg = worst / (2 * B) + 2 ** -18 / B
    g_b = e["dy"]                                              # bf16(g), eager's
    d_g = dg * (1 + 2 * U1) + 2 * U1 * g_b.abs()
    # the row layer's gradients (this rank's columns of its weight, its whole bias)
    w_got = grads["row.weight"]
    _within("row.weight", w_got, e["grad.row.weight"][:, cols],
            d_g.T @ e["h"][:, cols].abs() + U1 * (w_got.double().abs() + e["grad.row.weight"][:, cols].abs())
            + 2 * B * F32 * (g_b.abs().T @ e["h"][:, cols].abs()))
    b_got = grads["row.bias"]
    _within("row.bias", b_got, e["grad.row.bias"],
            d_g.sum(0) + U1 * (b_got.double().abs() + e["grad.row.bias"].abs()) + 2 * B * F32 * g_b.abs().sum(0))
    # back through the row layer and gelu to the column layer's gradients
    w = e["w_row"][:, cols].abs()
    d_h = (d_g @ w + 2 * U1 * e["dh"][:, cols].abs() + 2 * C * F32 * (g_b.abs() @ w)) / (1 - U1)
    slope = _gelu_slope(e["z"][:, cols]).abs()
    d_z = (slope * d_h + 2 * U1 * e["dz"][:, cols].abs() + 2 ** -20 * e["dz"][:, cols].abs()) / (1 - U1)
    dz = e["dz"][:, cols].abs()
    w_got = grads["col.weight"]
    _within("col.weight", w_got, e["grad.col.weight"][cols],
            d_z.T @ e["x"].abs() + U1 * (w_got.double().abs() + e["grad.col.weight"][cols].abs())
            + 2 * B * F32 * (dz.T @ e["x"].abs()))
    b_got = grads["col.bias"]
    _within("col.bias", b_got, e["grad.col.bias"][cols],
            d_z.sum(0) + U1 * (b_got.double().abs() + e["grad.col.bias"][cols].abs()) + 2 * B * F32 * dz.sum(0))

