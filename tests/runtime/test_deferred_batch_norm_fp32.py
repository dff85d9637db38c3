"""Deferred BatchNorm in float32 on a channel whose mean is far from 0 (x = 100 + N(0,1)).

Each side's gradient is measured against the exact one: eager accumulation in float64 on
the same float32 weights and data (so only the arithmetic differs, not the inputs). Eager
float32 accumulation's own error is the noise floor; graphc's deferred BatchNorm
(accumulation 2) must stay within 10x of it. Error: |g - g_exact| / |g_exact| over all
gradients concatenated. Each micro-batch is normalised with its own statistics, as in eager
accumulation (tests/runtime/test_deferred_batch_norm.py).

Measured (CPU, torch's float32 kernels), error against exact, graphc / eager float32:
  BatchNorm on the data          one process 2.4e-6, data 2 2.1e-6 / 3.2e-6 (eager, batch
                                 permuted within micro-batches: 5.4e-6 from itself)
  Linear on the data, then BN    one process 8.4e-6, data 2 1.1e-5 / 8.5e-4 (permuted: 1.3e-3)
In the second, the Linear's weight gradient is sum(dz * x) with x ~ 100 and sum(dz) = 0 in
exact arithmetic, so it carries 100x the rounding of sum(dz). Eager's BatchNorm backward
leaves sum(dz) off by its mean's rounding; graphc's keeps it at 0 (See NOTE: synchronised
batch norm; before, with the shards' M2 merged by Chan's formula, data 2 was 3.3e-4 off),
hence 100x closer. So graphc against eager float32 differs by eager's own error (8.5e-4
here; issue 30 point 7's 5.4e-5 against eager is likely such a difference); in float64 7e-13,
where eager against itself permuted is 8e-13. For scale, the variance formed as
E[x^2] - E[x]^2 measures 2.8e-4 on the first model (88x eager), which this test fails.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from helpers import run_world

ACC, BATCH, WIDTH = 2, 64, 8


class Net(nn.Module):
    """x [N, 8] -> (Linear) -> BatchNorm1d -> ReLU -> Linear(8, 3)."""

    def __init__(self, linear_first: bool):
        super().__init__()
        self.pre = nn.Linear(WIDTH, WIDTH) if linear_first else nn.Identity()
        self.bn = nn.BatchNorm1d(WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.pre(x))))


class Recording(torch.optim.SGD):
    """Keeps the step's gradients instead of stepping."""

    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() for group in self.param_groups for p in group["params"]]


class Deferred(graphc.Graph):
    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(ACC)
        self.config.set_deferred_batch_norm(True)
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _problem(linear_first: bool, dtype: torch.dtype):
    """The float32 model and batch, in `dtype` (float64: the same values, exactly)."""
    g = torch.Generator().manual_seed(3)
    x = (100 + torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)).float()
    y = torch.randint(0, 3, (BATCH,), generator=g)
    torch.manual_seed(0)
    return Net(linear_first).float().to(dtype), x.to(dtype), y


def _eager(linear_first, dtype, order=None):
    model, x, y = _problem(linear_first, dtype)
    if order is not None:
        x, y = x[order], y[order]
    for xs, ys in zip(x.chunk(ACC), y.chunk(ACC)):
        (F.cross_entropy(model(xs), ys) / ACC).backward()
    return [p.grad for p in model.parameters()]


def _graphc(linear_first):
    model, x, y = _problem(linear_first, torch.float32)
    opt = Recording(model.parameters(), lr=0.0)
    Deferred(model, opt)(x, y)
    return opt.grads


def _rows(t, rank, world):
    """This rank's rows, such that micro-batch k of the split batch is eager's t.chunk(ACC)[k]."""
    return torch.cat([part.chunk(world)[rank] for part in t.chunk(ACC)])


def _graphc_data_parallel(rank, world, linear_first):
    model, x, y = _problem(linear_first, torch.float32)
    ranks = graphc.placement("cpu", list(range(world)))
    graphc.to_global(model, placement=ranks, sbp=sbp.broadcast)
    opt = Recording(model.parameters(), lr=0.0)
    x, y = (graphc.to_global(_rows(t, rank, world), placement=ranks, sbp=sbp.split(0)) for t in (x, y))
    Deferred(model, opt)(x, y)
    return opt.grads  # the full local gradients: the parameters are broadcast


def _error(got, exact):
    got = torch.cat([g.double().flatten() for g in got])
    exact = torch.cat([g.double().flatten() for g in exact])
    return ((got - exact).norm() / exact.norm()).item()


def _check(got, linear_first, what):
    exact = _eager(linear_first, torch.float64)
    floor = _error(_eager(linear_first, torch.float32), exact)
    error = _error(got, exact)
    assert error <= 10 * floor, (f"{what}, x = 100 + N(0,1), float32: gradient {error:.1e} off "
                                 f"exact, eager float32 {floor:.1e} (allowed 10x)")


MODELS = pytest.mark.parametrize("linear_first", [False, True], ids=["bn-on-data", "linear-then-bn"])


@pytest.mark.fp32
@MODELS
def test_deferred_batch_norm_fp32_large_mean_within_eager_rounding(linear_first):
    _check(_graphc(linear_first), linear_first, "deferred BatchNorm, accumulation 2")


@pytest.mark.fp32
@pytest.mark.world
@pytest.mark.parametrize("linear_first", [False, pytest.param(True, marks=pytest.mark.slow)],   # CI time: the
                         ids=["bn-on-data", "linear-then-bn"])   # zero-sum is tests/runtime/test_sync_batch_norm.py's
def test_deferred_sync_batch_norm_fp32_large_mean_within_eager_rounding(linear_first):
    for rank, got in enumerate(run_world(_graphc_data_parallel, 2, linear_first)):
        _check(got, linear_first, f"deferred sync BatchNorm, data 2 x accumulation 2, rank {rank}")
