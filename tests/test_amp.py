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
from layouts import Pair, declare, train

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


# -- a stage that starts with a LayerNorm (issue 30, point D) ----------------------------------
class NormFirst(nn.Module):
    """Stage 1 of the layout matrix's Pair when it starts with a LayerNorm: CPU autocast leaves
    layer_norm alone, so it runs on the bf16 activation the stage receives, with float32
    weights, and returns bf16."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, h):
        return self.fc(self.norm(h))


class NormFirstGraph(graphc.Graph):
    def __init__(self, layout):
        super().__init__()
        torch.manual_seed(0)
        self.model = _norm_first_pair()
        declare(self, layout)
        self.config.enable_amp(True, dtype=torch.bfloat16)
        self.config.set_gradient_accumulation_steps(M)
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))

    def build(self, x, y):
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        return loss


def _norm_first_pair():
    pair = Pair()
    pair.b = NormFirst()
    return pair


def _one_thread_eager_autocast(batches):
    """Eager autocast on the same micro-batches, on one intra-op thread as every rank of a
    local world (or torchrun) computes: the mixed-dtype LayerNorm's weight and bias gradients
    are sums whose order depends on the thread count (at 2 threads they differ by ~5e-5 after
    one SGD step, which was issue 30's report), the only thing that differs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = _norm_first_pair()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for x, y in batches:
            opt.zero_grad()
            parts = []
            for xs, ys in zip(x.chunk(M), y.chunk(M)):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = ((model(xs) - ys) ** 2).mean()
                (loss / M).backward()
                parts.append(loss.detach())
            opt.step()
            losses.append(torch.stack(parts).mean().item())
        return losses, model.state_dict()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("layout", ["one", "pp2"])
def test_a_stage_starting_with_a_layer_norm_equals_eager_autocast_bitwise(layout):
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)) for _ in range(STEPS)]
    want_losses, want_state = _one_thread_eager_autocast(batches)
    losses, state = train(layout, NormFirstGraph, batches)
    assert losses == want_losses
    for k, v in want_state.items():
        assert torch.equal(state[k], v), (k, (state[k] - v).abs().max())
