"""config.enable_amp (NOTE: Autocast regions): build() under torch.autocast, fp32 master
parameters and fp32 gradient accumulation. CPU autocast to bfloat16 is deterministic, so
graphc equals an eager reference running the same micro-batches under torch.autocast with
float32 parameters, accumulating float32 gradients in the same order, bit for bit: in one
process and on a 2-stage pipeline of real gloo ranks."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from helpers import run_world

pytestmark = pytest.mark.fp32
M, STEPS = 2, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stage0 = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32))
        self.stage1 = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))

    def forward(self, x):
        return self.stage1(self.stage0(x))


class AmpGraph(graphc.Graph):
    """Net under bf16 autocast (amp), M micro-batches, on one rank or a pipeline of 2;
    param_dtype: config.set_param_dtype (tests/test_param_dtype.py)."""

    def __init__(self, model, opt, pipeline=False, amp=True, param_dtype=None):
        super().__init__()
        self.model = model
        if pipeline:
            self.model.stage0.config.set_stage(0, graphc.placement("cpu", [0]))
            self.model.stage1.config.set_stage(1, graphc.placement("cpu", [1]))
        if amp:
            self.config.enable_amp(True, dtype=torch.bfloat16)
        if param_dtype is not None:
            self.config.set_param_dtype(param_dtype)
        self.config.set_gradient_accumulation_steps(M)
        if opt is not None:
            self.add_optimizer(opt)

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(STEPS)]


def _eager(model):
    """The reference: each micro-batch's forward and loss under autocast, backward of loss/M
    outside it, float32 gradients accumulated in micro-batch order, one AdamW step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        parts = []
        for xs, ys in zip(x.chunk(M), y.chunk(M)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(xs), ys)
            (loss / M).backward()
            parts.append(loss.detach())
        opt.step()
        losses.append(torch.stack(parts).mean())
    return losses, model.state_dict()


def _graphc(rank, world, pipeline):
    """graphc's run, and (on ranks: with their one thread, as bf16 kernels block by thread
    count) eager's reference beside it."""
    torch.manual_seed(0)
    reference = _eager(Net()) if pipeline else None
    torch.manual_seed(0)
    model = Net()
    graph = AmpGraph(model, torch.optim.AdamW(model.parameters(), lr=1e-2), pipeline)
    losses = [graph(x, y).to_local().clone() for x, y in _batches()]
    dtypes = {p.dtype for p in model.parameters()}
    return losses, {k: v.clone() for k, v in graph.full_state_dict().items()}, dtypes, str(graph.plan), reference


def _check(losses, state, want_losses, want_state):
    for got, want in zip(losses, want_losses):
        if got.numel():
            assert torch.equal(got, want), (got, want)
    for k, v in want_state.items():
        assert torch.equal(state[k], v), k


def test_enable_amp_equals_eager_autocast_bitwise():
    torch.manual_seed(0)
    want_losses, want_state = _eager(Net())
    losses, state, dtypes, _, _ = _graphc(0, 1, False)
    assert dtypes == {torch.float32}  # master weights stay float32
    assert all(l.dtype == torch.float32 for l in losses)  # the loss: autocast's float32
    _check(losses, state, want_losses, want_state)


@pytest.mark.world
def test_enable_amp_on_a_pipeline_equals_eager_autocast_bitwise():
    results = run_world(_graphc, 2, True)
    assert any(r[0][0].numel() for r in results)
    for losses, state, dtypes, plan, (want_losses, want_state) in results:
        assert dtypes == {torch.float32}
        _check(losses, state, want_losses, want_state)
    assert "bf16" in results[0][3]  # the activation sent between stages travels in bfloat16


def test_enable_amp_refuses_other_dtypes():
    with pytest.raises(graphc.GraphcError, match="torch.bfloat16 or torch.float16"):
        graphc.Graph().config.enable_amp(True, dtype=torch.float64)
