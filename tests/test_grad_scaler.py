"""graphc.amp.GradScaler with float16 autocast (NOTE: Loss scaling, graphc/amp.py): an inf
injected into one stage's gradients on one step makes every rank skip that step and back the
scale off; the run, scale by scale and parameter by parameter, is eager's torch.amp.GradScaler
loop, bit for bit (CPU float16 autocast, powers of two for the scales, one thread per rank
for both). One process and a 2-stage pipeline on real gloo ranks."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from helpers import run_world

pytestmark = pytest.mark.fp32
M, STEPS, POISONED = 2, 5, 2
SCALER = dict(init_scale=2.0 ** 8, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)


class Poison(torch.autograd.Function):
    """Identity forward; backward makes the gradient inf where `flag` is set (stage 0 only)."""

    @staticmethod
    def forward(ctx, h, flag):
        ctx.save_for_backward(flag)
        return h.clone()

    @staticmethod
    def backward(ctx, grad):
        flag, = ctx.saved_tensors
        return grad * torch.where(flag > 0, float("inf"), 1.0).to(grad.dtype), None


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stage0 = nn.Linear(16, 32)
        self.stage1 = nn.Linear(32, 5)

    def forward(self, x, flag):
        return self.stage1(F.gelu(Poison.apply(self.stage0(x), flag)))


class ScaledGraph(graphc.Graph):
    def __init__(self, model, opt, pipeline):
        super().__init__()
        self.model = model
        if pipeline:
            self.model.stage0.config.set_stage(0, graphc.placement("cpu", [0]))
            self.model.stage1.config.set_stage(1, graphc.placement("cpu", [1]))
        self.config.enable_amp(True, dtype=torch.float16)
        self.config.set_gradient_accumulation_steps(M)
        self.set_grad_scaler(graphc.amp.GradScaler(**SCALER))
        self.add_optimizer(opt)

    def build(self, x, flag, y):
        loss = F.cross_entropy(self.model(x, flag), y)
        loss.backward()
        return loss


def _batches():
    g = torch.Generator().manual_seed(0)
    # flag has one entry (not the batch's length): every micro-batch gets it whole
    return [(torch.randn(8, 16, generator=g), torch.full((1,), float(step == POISONED)),
             torch.randint(0, 5, (8,), generator=g)) for step in range(STEPS)]


def _eager(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    scales = []
    for x, flag, y in _batches():
        for xs, ys in zip(x.chunk(M), y.chunk(M)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(xs, flag), ys)
            scaler.scale(loss / M).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales, model.state_dict()


def _run(rank, world, pipeline):
    torch.manual_seed(0)
    want = _eager(Net())
    torch.manual_seed(0)
    model = Net()
    graph = ScaledGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), pipeline)
    scales = []
    for x, flag, y in _batches():
        graph(x, flag, y)
        scales.append(graph.grad_scaler.get_scale())
    state = {k: v.clone() for k, v in graph.full_state_dict().items()}
    return scales, state, graph.grad_scaler.skipped_steps, want


def _check(result):
    scales, state, skipped, (want_scales, want_state) = result
    assert scales == want_scales, (scales, want_scales)
    assert scales[POISONED] == scales[POISONED - 1] / 2  # backed off at the poisoned step
    assert skipped == 1
    for k, v in want_state.items():
        assert torch.equal(state[k], v), k


def test_grad_scaler_skips_and_backs_off_like_eager():
    torch.set_num_threads(1)
    _check(_run(0, 1, False))


@pytest.mark.world
def test_an_inf_on_one_stage_skips_the_step_on_every_rank():
    for result in run_world(_run, 2, True):
        _check(result)


def test_grad_scaler_arguments_are_checked():
    with pytest.raises(graphc.GraphcError, match="backoff_factor must be in"):
        graphc.amp.GradScaler(backoff_factor=2.0)
    with pytest.raises(graphc.GraphcError, match="expects a graphc.amp.GradScaler"):
        graphc.Graph().set_grad_scaler(torch.amp.GradScaler("cpu"))


def test_the_scale_is_in_the_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = Net()
    graph = ScaledGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), False)
    batches = _batches()
    for x, flag, y in batches[:POISONED]:  # the scale has grown once: 2**9
        graph(x, flag, y)
    path = str(tmp_path / "rank0.pt")
    graphc.save(graph.state_dict(), path)
    torch.manual_seed(0)
    fresh = Net()
    resumed = ScaledGraph(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), False)
    resumed.load_state_dict(graphc.load(path))
    resumed(*batches[POISONED])  # the poisoned step backs off from the saved scale
    graph(*batches[POISONED])
    assert resumed.grad_scaler.state_dict() == graph.grad_scaler.state_dict()
    assert resumed.grad_scaler.get_scale() == 2.0 ** 8  # a fresh scaler would be at 2**7
