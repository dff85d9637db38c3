"""Python and in-place side effects in build() (NOTE: Tensors outside the trace, NOTE:
Attribute writes): tensors build() makes and writes into, parameters reached through
parameters(), counters, an EMA teacher. Each trains as eager does on every layout of the
matrix (tests/layouts.py; float64, 1e-10 against a plain eager loop on the whole batch),
or is refused with the user's line and the fix."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import graphc
from graphc.passes.trace_build import trace_build
from layouts import Computing, Pair, assert_same, declare, every_layout, fallbacks, train

D_OUT = 4


def batches(n: int = 3, b: int = 8):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(b, 6, generator=g), torch.randn(b, D_OUT, generator=g)) for _ in range(n)]


def accumulated(out, y):
    """build()'s extra terms written with tensors made in build() and written in place."""
    buf = torch.zeros(D_OUT)
    buf.add_(out.mean(0))
    idx = out.detach().argmax(-1)
    counts = torch.zeros(D_OUT).scatter_add_(0, idx, out.pow(2).mean(-1) / out.shape[0])
    rows = torch.zeros(2, D_OUT)
    rows[0] += out.mean(0)  # through a view, stored back
    rows[1] = out.pow(2).mean(0)
    return buf.pow(2).sum() + counts.sum() + rows.pow(2).sum()


def l2(model):
    return 1e-2 * sum(p.pow(2).sum() for p in model.parameters())


def eager(make_model, bs, extra):
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in bs:
        out = model(x)
        loss = ((out - y) ** 2).mean() + extra(model, out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


class Trained(graphc.Graph):
    def __init__(self, model, layout, extra, acc=1):
        super().__init__()
        self.model = model
        self.extra = extra
        declare(self, layout)
        self.config.set_gradient_accumulation_steps(acc)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, x, y):
        out = self.model(x)
        loss = ((out - y) ** 2).mean() + self.extra(self.model, out, y)
        loss.backward()
        return loss


def graph_maker(extra, acc=1, make_model=Pair):
    def make(layout):
        torch.manual_seed(0)
        return Trained(make_model(), layout, extra, acc)
    return make


@every_layout
def test_tensor_made_in_build_written_in_place(layout):
    """torch.zeros(n).add_(x) / .scatter_add_(...): a fresh tensor every step, as in eager."""
    extra = lambda model, out, y: accumulated(out, y)  # noqa: E731
    bs = batches()
    assert_same(train(layout, graph_maker(extra), bs), eager(Pair, bs, extra), layout)


def expert_load(model, out, y):
    """A mixture-of-experts load-balancing loss as DeepSeek's gate writes it: expert counts
    scattered into torch.zeros(batch, experts) with the batch size read off the shape."""
    rows, experts = out.shape
    scores = out.softmax(-1)
    top = torch.topk(scores, 2, dim=-1).indices
    counts = torch.zeros(rows, experts)
    counts.scatter_add_(1, top, torch.ones(rows, 2)).div_(2 / experts)
    return (counts * scores).sum(1).mean()


@every_layout
def test_expert_load_loss(layout):
    bs = batches()
    assert_same(train(layout, graph_maker(expert_load, acc=2), bs), eager(Pair, bs, expert_load), layout)


def augmented(model, out, y):
    """Augmented assignment and in-place methods on traced values (NOTE: In-place methods):
    `h += 1` and `h.mul_(2)` change every name bound to h, whatever the layout makes of h
    (split rows, a partial sum, a value received from another stage)."""
    h = out * 2
    r = h
    h += 1.0
    h.mul_(0.5)
    total = (r * h).mean()
    total.clamp_(max=100.0)
    return total * 0.1


@every_layout
def test_in_place_writes_reach_every_name(layout):
    bs = batches()
    assert_same(train(layout, graph_maker(augmented), bs), eager(Pair, bs, augmented), layout)


class LossPlusFloat64Term(graphc.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, x, y):
        out = self.model(x).float()
        loss = ((out - y.float()) ** 2).mean()
        loss += 1e-3 * out.double().pow(2).sum()   # as transformers adds a router's aux loss
        loss.backward()
        return loss


def test_augmented_assignment_keeps_its_dtype():
    """`loss += coef * aux` with a float64 aux leaves a float32 loss float32, as in eager
    (it came out float64: the Python operator fell back to loss = loss + ...)."""
    x, y = batches(1)[0]
    torch.manual_seed(0)
    model = Pair()
    got = LossPlusFloat64Term(model)(x, y).to_local()
    torch.manual_seed(0)
    ref = Pair()
    out = ref(x).float()
    want = ((out - y.float()) ** 2).mean()
    want += 1e-3 * out.double().pow(2).sum()
    assert got.dtype == want.dtype == torch.float32
    assert got.item() == want.item()


def test_a_view_read_after_an_in_place_write_is_refused():
    class ViewRead(Trained):
        def build(self, x, y):
            out = self.model(x) * 1.0
            first = out[0]
            out.add_(1.0)
            loss = ((out - y) ** 2).mean() + first.sum()
            loss.backward()
            return loss
    graph = ViewRead(Pair(), "one", None)
    with pytest.raises(graphc.GraphcError, match=r"writes into a tensor .*then reads 'getitem'.*Fix: take the view after"):
        graph(*batches(1)[0])


def test_no_constant_written_in_place():
    """The traced graph writes into no get_attr constant."""
    graph = Trained(Pair(), "one", lambda model, out, y: accumulated(out, y))
    gm = trace_build(graph._root, [torch.randn(8, 6), torch.randn(8, D_OUT)])
    written = [n for n in gm.graph.nodes if n.op == "call_method" and n.target.endswith("_")
               and n.target != "backward" and n.args[0].op == "get_attr"]
    assert not written, [n.format_node() for n in written]


@every_layout
def test_l2_penalty_over_parameters(layout):
    """sum(p.pow(2).sum() for p in model.parameters()): the parameters are graph values."""
    extra = lambda model, out, y: l2(model)  # noqa: E731
    bs = batches()
    assert_same(train(layout, graph_maker(extra, acc=2), bs), eager(Pair, bs, extra), layout)


class Logged(Trained):
    def build(self, x, y):
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            norm = torch.stack([p.norm() for _, p in self.model.named_parameters()]).sum()
        return norm, loss


@every_layout
def test_weight_norm_returned(layout):
    """A weight norm over named_parameters() returned from build() is this step's, not the trace's."""
    torch.manual_seed(0)
    model = Pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    for x, y in batches():
        want.append(sum(p.norm() for p in model.parameters()).item())
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()

    def make(layout):
        torch.manual_seed(0)
        return Logged(Pair(), layout, None, acc=2)
    got, _ = train(layout, make, batches())  # the first scalar output: the norm
    assert got == pytest.approx(want, abs=1e-10), (got, want)


class Counted(graphc.Graph):
    def __init__(self):
        super().__init__()
        self.model = Pair()
        self.step = 0

    def build(self, x, y):
        self.step += 1
        return ((self.model(x) - y) ** 2).mean()


class CountingPair(Pair):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


class Forward(graphc.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def build(self, x):
        return self.model(x)


def test_counter_in_build_refused():
    x, y = batches(1)[0]
    with pytest.raises(graphc.GraphcError) as e:
        Counted()(x, y)
    msg = str(e.value)
    assert "'self.step' from 0 to 1" in msg and "test_side_effects.py" in msg, msg
    assert "move `self.step += 1` out of build()" in msg, msg


def test_counter_in_forward_refused():
    x, _ = batches(1)[0]
    with pytest.raises(graphc.GraphcError) as e:
        Forward(CountingPair())(x)
    msg = str(e.value)
    assert "'model.calls' from 0 to 1" in msg and "move `self.calls += 1` out of build()" in msg, msg


def test_eval_in_build_allowed():
    """A write that does not read the old value (teacher.eval()) leaves the same state every call."""
    class Evaluating(Forward):
        def build(self, x):
            self.model.eval()
            return self.model(x)

    model = nn.Sequential(nn.Linear(6, 4), nn.Dropout(0.5))
    x, _ = batches(1)[0]
    out = Evaluating(model)(x).to_local()
    assert not model.training
    torch.testing.assert_close(out, model(x), rtol=0, atol=1e-12)


def _ema_mul(teacher, student):
    for p_t, p_s in zip(teacher.parameters(), student.parameters()):
        p_t.mul_(0.99).add_(p_s, alpha=0.01)


def _ema_attribute(teacher, student):
    teacher.a.weight.mul_(0.99)


def _ema_data(teacher, student):
    for p_t, p_s in zip(teacher.parameters(), student.parameters()):
        p_t.data.mul_(0.99)


def _ema_data_assigned(teacher, student):
    for p_t, p_s in zip(teacher.parameters(), student.parameters()):
        p_t.data = 0.99 * p_t.data + 0.01 * p_s.data


def _ema_foreach(teacher, student):
    torch._foreach_mul_(list(teacher.parameters()), 0.99)


@pytest.mark.parametrize("update, op, line", [
    (_ema_mul, "mul_", "p_t.mul_(0.99)"), (_ema_attribute, "mul_", "teacher.a.weight.mul_(0.99)"),
    (_ema_data, "mul_", "p_t.data.mul_(0.99)"), (_ema_data_assigned, ".data =", "p_t.data = 0.99"),
    (_ema_foreach, "_foreach_mul_", "torch._foreach_mul_")])
def test_ema_teacher_in_build_refused(update, op, line):
    """An EMA teacher updated in build() under no_grad would move per micro-batch or per
    trace, never once per step: refused, naming the parameter, the line and the fix."""
    class Distilled(graphc.Graph):
        def __init__(self):
            super().__init__()
            self.model = Pair()
            self.teacher = Pair().requires_grad_(False)
            self.config.set_gradient_accumulation_steps(2)
            self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))

        def build(self, x, y):
            loss = ((self.model(x) - self.teacher(x)) ** 2).mean()
            loss.backward()
            with torch.no_grad():
                update(self.teacher, self.model)
            return loss

    x, y = batches(1)[0]
    graph = Distilled()
    before = {k: v.clone() for k, v in graph.teacher.state_dict().items()}
    with pytest.raises(graphc.GraphcError) as e:
        graph(x, y)
    msg = str(e.value)
    assert f"parameter 'teacher.a.weight' in place ({op})" in msg and line in msg, msg
    assert "update it after the graph call" in msg, msg
    for k, v in graph.teacher.state_dict().items():  # nothing ran while tracing
        assert torch.equal(v, before[k]), k


def test_traced_tensor_stored_on_the_graph_refused():
    class Stored(Forward):
        def build(self, x):
            out = self.model(x)
            self.last = out
            return out

    x, _ = batches(1)[0]
    with pytest.raises(graphc.GraphcError) as e:
        Stored(Pair())(x)
    assert "stores a traced tensor in 'self.last'" in str(e.value) and "return loss, last" in str(e.value)


def test_counter_with_accumulation_refused_on_the_first_trace():
    class Accumulated(Counted):
        def __init__(self):
            super().__init__()
            self.config.set_gradient_accumulation_steps(2)

    x, y = batches(1)[0]
    graph = Accumulated()
    with pytest.raises(graphc.GraphcError, match="'self.step' from 0 to 1"):
        graph(x, y)
    assert graph.step == 0


def test_counter_in_a_class_attribute_refused():
    class ClassCounted(Forward):
        calls = 0

        def build(self, x):
            self.calls += 1
            return self.model(x)

    x, _ = batches(1)[0]
    with pytest.raises(graphc.GraphcError, match="'self.calls' from 0 to 1"):
        ClassCounted(Pair())(x)


def test_write_into_a_view_of_a_written_tensor_refused():
    """buf[0] taken before buf's traced write would see it in eager: refused, naming both lines."""
    class Viewed(Forward):
        def build(self, x):
            out = self.model(x)
            buf = torch.zeros(2, D_OUT)
            row = buf[0]
            row.add_(out.mean(0))
            return buf.sum()

    x, _ = batches(1)[0]
    with pytest.raises(graphc.GraphcError, match=r"shares memory with a tensor it wrote in place at .*row.add_"):
        Viewed(Pair())(x)


HELD = torch.zeros(D_OUT)


def test_write_into_a_held_tensor_refused():
    """A plain tensor (a global, an unregistered attribute) written in build() is state graphc
    could not keep per call: refused, with the fix (a buffer)."""
    class Held(Forward):
        def build(self, x):
            out = self.model(x)
            HELD.add_(out.mean(0).detach())
            return out

    x, _ = batches(1)[0]
    with pytest.raises(graphc.GraphcError, match=r"HELD.add_.*register_buffer"):
        Held(Pair())(x)


def _detached(out, y):
    """A detached batch statistic first (what a user logs), then the loss."""
    loss = ((out - y) ** 2).mean()
    return out.detach().sum(), loss.detach(), loss


@every_layout
def test_detached_values_keep_their_layout(layout):
    """`detach` has an SBP rule (a linear unary op): a detached split or partial value is not
    gathered to run whole (the slow path infer_sbp warns of), and what it returns is eager's."""
    torch.manual_seed(0)
    model = Pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    for x, y in batches():
        out = model(x)
        loss = ((out - y) ** 2).mean()
        want.append(out.detach().sum().item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    graphs = []
    got, _ = train(layout, lambda lay: Computing(lay, _detached), batches(), graphs=graphs)   # the first scalar output
    assert got == pytest.approx(want, abs=1e-10), (got, want)
    assert fallbacks(graphs[0]) == []
