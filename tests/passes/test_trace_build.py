"""trace_build: models as their authors wrote them trace, and train exactly like eager.

One-process graphs (a world of one rank) with gradient accumulation 2, in float64 against
eager PyTorch (helpers.assert_same_as_eager, 1e-10): shape-reading code, custom autograd
Functions, no_grad regions, buffers updated in forward, *args signatures, a second input
shape, Graph attributes changed between calls; refusals name the user's line and the fix.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import GraphcError
from helpers import accumulate_grads, assert_same_as_eager

VOCAB, BLOCK, D = 11, 16, 8


class TinyGPT(nn.Module):
    """nanoGPT-style front door: size() unpacking, a shape assert, arange from a size, view."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(BLOCK, D)
        self.ln = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.block_size = BLOCK

    def forward(self, idx):
        b, t = idx.size()
        assert t <= self.block_size, f"cannot forward a sequence of length {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        if x.dim() == 3 and len(x) == b:
            x = self.ln(x).view(b, t, x.shape[-1])
        return self.lm_head(x)


def lm_loss(logits, y):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


class LMGraph(graphc.Graph):
    def __init__(self, model, opt, acc=2):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(acc)
        self.add_optimizer(opt)

    def build(self, idx, y):
        loss = lm_loss(self.model(idx), y)
        loss.backward()
        return loss


def train_pair(make_model, make_graph, batches, eager_step=None, lr=0.1):
    """Trains the same model through graphc and eager; returns both (losses, state)."""
    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model)
    graph = make_graph(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    got, want = [], []
    for batch in batches:
        got.append(graph(*batch).to_local().item())
        ref_opt.zero_grad()
        want.append(eager_step(ref, *batch) if eager_step else _default_step(ref, *batch))
        ref_opt.step()
    return (got, model.state_dict()), (want, ref.state_dict()), graph


def _default_step(model, x, y):
    loss = lm_loss(model(x), y)
    loss.backward()
    return loss.item()


def lm_batches(n, b=4, t=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (b, t), generator=g), torch.randint(0, VOCAB, (b, t), generator=g))
            for _ in range(n)]


def test_shape_reading_model_trains_like_eager():
    (got, state), (want, ref), graph = train_pair(TinyGPT, LMGraph, lm_batches(3))
    assert_same_as_eager(got, state, want, ref, "TinyGPT, accumulation 2")
    targets = {n.target for n in graph.compiled.gm.graph.nodes}
    assert not targets & {"size", "dim", getattr}, "shapes must be constants of the graph"


def test_second_input_shape_compiles_a_second_plan():
    """The last, partial batch of an epoch: a smaller batch and a shorter sequence."""
    batches = lm_batches(2) + lm_batches(1, b=2, t=5, seed=2) + lm_batches(1, seed=3)
    (got, state), (want, ref), graph = train_pair(TinyGPT, LMGraph, batches)
    assert_same_as_eager(got, state, want, ref, "batch 4, 4, 2, 4")
    assert len(graph._cache.entries) == 2


def test_compile_leaves_every_buffer_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.BatchNorm1d(6, momentum=None))
    before = {k: v.clone() for k, v in model.state_dict().items()}

    class G(graphc.Graph):
        def __init__(self):
            super().__init__()
            self.model = model

        def build(self, x):
            return self.model(x)

    G().compile(torch.randn(8, 4))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"compiling changed buffer {k}"


def test_batchnorm_momentum_none_trains_like_eager():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 6)
            self.bn = nn.BatchNorm1d(6, momentum=None)
            self.out = nn.Linear(6, 3)

        def forward(self, x):
            return self.out(torch.relu(self.bn(self.l(x))))

    class G(graphc.Graph):
        def __init__(self, model, opt):
            super().__init__()
            self.model = model
            self.add_optimizer(opt)

        def build(self, x, y):
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            return loss

    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]

    def step(model, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss.item()
    (got, state), (want, ref), _ = train_pair(Net, G, batches, step)
    assert_same_as_eager(got, state, want, ref, "BatchNorm(momentum=None), accumulation 1")
    assert state["bn.num_batches_tracked"].item() == 3


class ScaleGrad(torch.autograd.Function):
    """Forward x * 2; a custom backward that differs from autodiff's (grad * 0.5)."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * ctx.k, None


class FnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.b(ScaleGrad.apply(torch.tanh(self.a(x)), 0.5))


class ClsGraph(graphc.Graph):
    def __init__(self, model, opt, acc=2):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(acc)
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def cls_batches(n, b=8, d=6, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, d, generator=g), torch.randint(0, classes, (b,), generator=g)) for _ in range(n)]


def cls_step(model, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.item()


def test_custom_autograd_function_keeps_its_backward():
    (got, state), (want, ref), graph = train_pair(FnNet, ClsGraph, cls_batches(3), cls_step)
    assert_same_as_eager(got, state, want, ref, "custom autograd.Function")
    assert "ScaleGrad_apply" in graph.compiled.gm.code


class Distill(nn.Module):
    """A frozen-by-no_grad teacher and a student; eager never trains the teacher."""

    def __init__(self):
        super().__init__()
        self.teacher, self.student = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x):
        with torch.no_grad():
            soft = self.teacher(x).softmax(-1)
            with torch.enable_grad():
                soft = soft * 1.0
        return self.student(x), soft


class DistillGraph(ClsGraph):
    def build(self, x, y):
        logits, soft = self.model(x)
        loss = F.cross_entropy(logits, y) + F.cross_entropy(logits, soft)
        loss.backward()
        return loss


def distill_step(model, x, y):
    logits, soft = model(x)
    loss = F.cross_entropy(logits, y) + F.cross_entropy(logits, soft)
    loss.backward()
    return loss.item()


def test_no_grad_regions_are_kept():
    torch.manual_seed(0)
    (got, state), (want, ref), graph = train_pair(Distill, DistillGraph, cls_batches(3), distill_step)
    assert_same_as_eager(got, state, want, ref, "no_grad teacher")
    torch.manual_seed(0)  # train_pair seeds 0 before building its model: the same initial teacher
    first = Distill()
    assert torch.equal(state["teacher.weight"], first.teacher.weight), "the teacher was trained"
    assert "_set_grad_enabled" in graph.compiled.programs[0].module.code


class Counting(nn.Module):
    """Buffers updated in forward: a call counter and an EMA of the input mean."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(6, 3)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(6))

    def forward(self, x):
        self.calls.add_(1)
        self.ema.mul_(0.9).add_(0.1 * x.mean(0))
        return self.l(x - self.ema)


def accumulate(model, x, y):
    """Eager gradient accumulation over 2 micro-batches (forward, and buffer updates, twice)."""
    return accumulate_grads(model, F.cross_entropy, x, y, 2)


def test_buffers_updated_in_forward_run_once_per_micro_batch():
    """As in eager gradient accumulation: forward (and its buffer updates) once per micro-batch."""
    (got, state), (want, ref), _ = train_pair(Counting, ClsGraph, cls_batches(3), accumulate)
    assert_same_as_eager(got, state, want, ref, "buffers updated in forward")
    assert state["calls"].item() == 6


class StarGraph(ClsGraph):
    def build(self, *xs):
        loss = F.cross_entropy(self.model(xs[0]), xs[1])
        loss.backward()
        return loss


def test_star_args_build():
    (got, state), (want, ref), _ = train_pair(FnNet, StarGraph, cls_batches(3), cls_step)
    assert_same_as_eager(got, state, want, ref, "build(self, *xs)")


class TempGraph(ClsGraph):
    temperature = 1.0

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x) / self.temperature, y)
        loss.backward()
        return loss


def test_graph_attribute_changed_after_the_first_call_recompiles():
    batches = cls_batches(4)
    temps = [1.0, 1.0, 2.0, 2.0]

    torch.manual_seed(0)
    model = FnNet()
    ref = copy.deepcopy(model)
    graph = TempGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    got, want = [], []
    for (x, y), temp in zip(batches, temps):
        graph.temperature = temp
        got.append(graph(x, y).to_local().item())
        ref_opt.zero_grad()
        loss = F.cross_entropy(ref(x) / temp, y)
        loss.backward()
        ref_opt.step()
        want.append(loss.item())
    assert_same_as_eager(got, model.state_dict(), want, ref.state_dict(), "temperature 1 then 2")


def test_clip_grad_norm_inside_build_is_refused_with_the_option():
    class Clipping(ClsGraph):
        def build(self, x, y):
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            return loss

    model = FnNet()
    g = Clipping(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(GraphcError, match="set_grad_clip_norm") as info:
        g(*cls_batches(1)[0])
    assert "test_trace_build.py" in str(info.value), "the error names the user's line"


def test_control_flow_on_values_is_refused_at_the_users_line():
    class Branchy(ClsGraph):
        def build(self, x, y):
            out = self.model(x)
            if out.sum() > 0:
                out = out * 2
            loss = F.cross_entropy(out, y)
            loss.backward()
            return loss

    model = FnNet()
    g = Branchy(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(GraphcError, match="if out.sum\\(\\) > 0") as info:
        g(*cls_batches(1)[0])
    assert "torch.where" in str(info.value)


@pytest.mark.parametrize("op, line", [
    ("nonzero", "keep = out.nonzero()"),
    ("index", "keep = out[out > 0]"),
    ("masked_select", "keep = torch.masked_select(out, out > 0)"),
])
def test_a_data_dependent_shape_is_refused_at_its_line(op, line):
    class Picky(ClsGraph):
        def build(self, x, y):
            out = self.model(x)
            if op == "nonzero":
                keep = out.nonzero()
            elif op == "index":
                keep = out[out > 0]
            else:
                keep = torch.masked_select(out, out > 0)
            loss = F.cross_entropy(out, y) + keep.sum()
            loss.backward()
            return loss

    model = FnNet()
    g = Picky(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(GraphcError, match="the shape of its result depends on the values") as info:
        g(*cls_batches(1)[0])
    assert "test_trace_build.py:" in str(info.value) and line in str(info.value)
    assert "torch.where(mask, x, 0)" in str(info.value)


def test_shapes_are_one_micro_batch():
    """With accumulation 2, build() sees half the batch: a view(b, ...) uses that b."""
    torch.manual_seed(0)
    model = TinyGPT()
    graph = LMGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), acc=2)
    graph.compile(*lm_batches(1, b=4, t=6)[0])
    views = [n for n in graph.compiled.gm.graph.nodes if n.target == "view" and len(n.args) == 4]
    assert views and views[0].args[1:3] == (2, 6)


class Reassigning(nn.Module):
    """Buffers written the other two common ways: `+=` and rebinding to a new value."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(6, 3)
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(6))

    def forward(self, x):
        self.steps += 1
        self.ema = 0.9 * self.ema + 0.1 * self.l.weight.detach().mean(0)
        return self.l(x - self.ema) * (1 + self.steps / 100)


def test_buffers_reassigned_in_forward_run_once_per_micro_batch():
    (got, state), (want, ref), _ = train_pair(Reassigning, ClsGraph, cls_batches(3), accumulate)
    assert_same_as_eager(got, state, want, ref, "buffers reassigned in forward")
    assert state["steps"].item() == 6


class NoisyGraph(ClsGraph):
    """Noise drawn inside build() from a factory with no tensor input."""

    def build(self, x, y):
        noise = torch.randn(x.shape[0], 6) * 0.1
        loss = F.cross_entropy(self.model(x + noise), y)
        loss.backward()
        return loss


def test_random_factories_draw_on_every_step():
    """torch.randn(...) in build() is a node drawing on every step, as eager draws: same RNG
    stream, same numbers (one process, accumulation 1)."""
    batches = cls_batches(3)
    torch.manual_seed(0)
    model = FnNet()
    ref = copy.deepcopy(model)
    graph = NoisyGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), acc=1)
    torch.manual_seed(5)
    got = [graph(x, y).to_local().item() for x, y in batches]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(5)
    want = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(ref(x + torch.randn(x.shape[0], 6) * 0.1), y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    assert_same_as_eager(got, model.state_dict(), want, ref.state_dict(), "randn in build()")
    assert any(getattr(n.target, "__name__", "") == "randn" for n in graph.compiled.gm.graph.nodes)


class ScalarOverloads(torch.nn.Module):
    """torch functions with Scalar overloads (GPT-2's gelu_new: torch.pow(h, 3.0)): torch's
    argument parser once took a traced value for a real tensor here and crashed."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        h = 0.5 * h * (1.0 + torch.tanh(0.79788456 * (h + 0.044715 * torch.pow(h, 3.0))))
        h = torch.where(h > 0, h, 0.0) + torch.remainder(h, 2.0) + torch.float_power(h.abs(), 2.0)
        return h.square().mean()


def test_scalar_overloads_trace_like_eager():
    class G(graphc.Graph):
        def __init__(self, model):
            super().__init__()
            self.model = model
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

        def build(self, x):
            loss = self.model(x)
            loss.backward()
            return loss

    torch.manual_seed(0)
    model, x = ScalarOverloads(), torch.randn(6, 4)
    want = model(x).item()
    assert abs(G(model)(x).to_local().item() - want) < 1e-12
