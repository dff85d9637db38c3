"""Guards (NOTE: Guards, graphc/guards/__init__.py): a Python value build() read is checked on every
call; a change compiles (and caches) another plan, or is a GraphcError where it cannot.

Each case runs a user's habit between calls (model.eval(), an annealed attribute, a Graph
config object, leftover .grad, a module swap) against eager PyTorch on the whole batch in
float64 (helpers.assert_same_as_eager, 1e-10). The multi-rank cases run on real gloo ranks.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc.guards import fingerprint
from helpers import assert_close, run_world

D, C, B = 6, 3, 8


class BNNet(nn.Module):
    """BatchNorm: train mode uses batch statistics and updates running ones; eval reads them."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(D, 8)
        self.bn = nn.BatchNorm1d(8)
        self.l2 = nn.Linear(8, C)
        self.tau = 1.0

    def forward(self, x):
        return self.l2(torch.relu(self.bn(self.l1(x)))) / self.tau


class HFStyle(nn.Module):
    """Hugging Face's habits: F.dropout(training=self.training), `if self.training:`."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(D, 8)
        self.l2 = nn.Linear(8, C)

    def forward(self, x):
        h = F.dropout(torch.tanh(self.l1(x)), 0.5, training=self.training)
        if self.training:
            h = h * 2.0
        return self.l2(h)


class Cfg:
    def __init__(self, aux_weight):
        self.aux_weight = aux_weight


class TrainGraph(graphc.Graph):
    def __init__(self, model, opt, m=1):
        super().__init__()
        self.model = model
        self.cfg = Cfg(0.0)
        self.config.set_gradient_accumulation_steps(m)
        self.add_optimizer(opt)

    def build(self, x, y):
        out = self.model(x)
        loss = F.cross_entropy(out, y) + self.cfg.aux_weight * out.square().mean()
        loss.backward()
        return loss


def _data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(B, D, generator=g), torch.randint(0, C, (B,), generator=g)


def _eager_step(model, opt, x, y, aux_weight):
    out = model(x)
    loss = F.cross_entropy(out, y) + aux_weight * out.square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


# each step: (model mode, tau, aux_weight) set between calls, as a user's loop does
HABITS = [("train", 1.0, 0.0), ("eval", 1.0, 0.0), ("train", 1.0, 0.0), ("train", 2.0, 0.0),
          ("train", 2.0, 0.5), ("eval", 1.0, 0.0)]


def _run_habits(model, graph_or_none, opt, rank_rows=None):
    losses = []
    for step, (mode, tau, aux) in enumerate(HABITS):
        model.train(mode == "train")
        model.tau = tau
        x, y = _data(step)
        if graph_or_none is None:
            losses.append(_eager_step(model, opt, x, y, aux))
            continue
        graph_or_none.cfg.aux_weight = aux  # the same Cfg object, mutated
        if rank_rows is not None:
            x = graphc.to_global(x[rank_rows], placement=graph_or_none.where, sbp=graphc.sbp.split(0))
            y = graphc.to_global(y[rank_rows], placement=graph_or_none.where, sbp=graphc.sbp.split(0))
        losses.append(graph_or_none(x, y).to_local().item())
    return losses


def _eager_reference():
    torch.manual_seed(0)
    model = BNNet()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    return model, _run_habits(ref, None, opt), ref.state_dict()


def test_mode_attribute_and_config_changes_follow_eager():
    model, want_losses, want_state = _eager_reference()
    graph = TrainGraph(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    losses = _run_habits(model, graph, None)
    assert_close(torch.tensor(losses), torch.tensor(want_losses), "losses")
    for k, v in want_state.items():
        assert_close(model.state_dict()[k], v, k)
    # train/eval x tau x aux: 4 distinct settings -> 4 plans; returning to one reuses it
    assert len(graph.recompiles) == 3, graph.recompiles
    assert any("model.training" in why or "model.bn.training" in why for why in graph.recompiles)
    assert any("model.tau" in why for why in graph.recompiles)
    assert any("self.cfg.aux_weight changed (compiled for 0.0, now 0.5)" in why for why in graph.recompiles)


def _dp_worker(rank, world):
    model, want_losses, want_state = _eager_reference()
    graph = TrainGraph(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    graph.where = graphc.placement("cpu", ranks=list(range(world)))
    rows = slice(rank * B // world, (rank + 1) * B // world)
    losses = _run_habits(model, graph, None, rank_rows=rows)
    state = {k: v.clone() for k, v in graph.full_state_dict().items()}
    return losses, want_losses, state, want_state, len(graph.recompiles)


@pytest.mark.world
def test_mode_switch_under_data_parallel_follows_eager():
    """model.eval() between calls under data parallel: BatchNorm reads its running statistics
    (and stops updating them) as eager does; it kept the compile-time mode before guards."""
    for losses, want_losses, state, want_state, recompiles in run_world(_dp_worker, 2):
        assert_close(torch.tensor(losses), torch.tensor(want_losses), "losses")
        for k, v in want_state.items():
            assert_close(state[k], v, k)
        assert recompiles == 3


def test_hf_style_training_flag_is_guarded():
    """F.dropout(training=self.training) and `if self.training:` follow model.eval()."""
    torch.manual_seed(1)
    model = HFStyle()
    ref = copy.deepcopy(model)
    graph = TrainGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = _data(0)
    graph(x, y)  # train mode: dropout on (graphc's own mask), h doubled
    _eager_step(ref, opt, x, y, 0.0)
    model.eval(), ref.eval()
    with torch.no_grad():  # the same starting point: graphc's and eager's masks differ in train
        for p, q in zip(ref.parameters(), model.parameters()):
            p.copy_(q)
    x, y = _data(1)
    loss = graph(x, y).to_local().item()
    want = _eager_step(ref, opt, x, y, 0.0)
    assert abs(loss - want) < 1e-10, (loss, want)
    assert graph.recompiles and "training" in graph.recompiles[-1]


def test_recompile_is_logged_with_its_reason(capsys):
    torch.manual_seed(0)
    model = BNNet()
    graph = TrainGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(0)
    graph(x, y)
    model.tau = 3.0
    capsys.readouterr()
    graph(x, y)
    assert "recompiling TrainGraph: model.tau changed (compiled for 1.0, now 3.0)" in capsys.readouterr().err


def test_guards_print_the_values_each_plan_was_compiled_under():
    """graph.compiled.guards prints one check a line, as thunder prints a prologue: the plan
    for tau = 1.0 and the one compiled after tau became 3.0 each state their own value."""
    torch.manual_seed(0)
    model = BNNet()
    graph = TrainGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(0)
    graph(x, y)
    first = str(graph.compiled.guards).splitlines()
    assert first[0] == f"# {len(graph.compiled.guards)} guards: the plan runs while every line holds (NOTE: Guards)"
    assert {"model.tau == 1.0", "self.cfg == Cfg(aux_weight=0.0)", "model.bn.training == True",
            "torch.get_default_dtype() == torch.float64"} <= set(first)
    assert any(line.startswith("model.l2 is <Linear at 0x") for line in first)
    model.tau = 3.0
    graph(x, y)
    second = graph.compiled.guards.text().splitlines()
    assert "model.tau == 3.0" in second and "model.tau == 1.0" not in second
    assert [g for g in second if not g.startswith("model.tau")] == [g for g in first if not g.startswith("model.tau")]


def test_cached_plans_are_reused_not_recompiled():
    torch.manual_seed(0)
    model = BNNet()
    graph = TrainGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(0)
    for _ in range(3):
        model.train(), graph(x, y)
        model.eval(), graph(x, y)
    assert len(graph.recompiles) == 1


def _swap_head(model):
    model.l2 = nn.Linear(8, C)


def _swap_weight(model):
    model.l1.weight = nn.Parameter(torch.zeros(8, D))


@pytest.mark.parametrize("swap, message", [
    (_swap_head, r"'model.l2' of TrainGraph was replaced by another Linear"),
    (_swap_weight, r"'model.l1.weight' .* replaced by another Parameter"),
])
def test_module_or_parameter_swap_is_refused(swap, message):
    """The old one kept running before guards; now it is an error naming what changed."""
    torch.manual_seed(0)
    model = BNNet()
    graph = TrainGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    graph(*_data(0))
    swap(model)
    with pytest.raises(graphc.GraphcError, match=message):
        graph(*_data(1))


def test_in_place_parameter_update_needs_no_recompile():
    torch.manual_seed(0)
    model = BNNet()
    graph = TrainGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    graph(*_data(0))
    with torch.no_grad():
        model.l1.weight.mul_(0.5)
    graph(*_data(1))
    assert graph.recompiles == []


@pytest.mark.parametrize("habit", ["sanity_backward_before", "grad_norm_between"])
def test_leftover_grads_never_leak_into_a_step(habit):
    """NOTE: The graph owns .grad: with an optimizer each step starts from no gradients."""
    torch.manual_seed(0)
    model = BNNet()
    ref = copy.deepcopy(model)
    graph = TrainGraph(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), m=2)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model.eval(), ref.eval()  # BatchNorm on running stats: micro-batches equal the whole batch
    for step in range(3):
        x, y = _data(step)
        if habit == "sanity_backward_before" and step == 0 or habit == "grad_norm_between":
            F.cross_entropy(model(x), y).backward()  # leaves .grad on the graph's parameters
        loss = graph(x, y).to_local().item()
        want = _eager_step(ref, opt, x, y, 0.0)
        assert abs(loss - want) < 1e-10, (step, loss, want)
    for k, v in ref.state_dict().items():
        assert_close(model.state_dict()[k], v, k)


class LayerDrop(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(D, C)

    def forward(self, x):
        import random
        if random.random() < 0.5:
            return self.l1(x)
        return self.l1(x) * 2


def test_python_random_in_forward_is_refused():
    model = LayerDrop()
    graph = TrainGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(graphc.GraphcError, match=r"random\.random\(\) at .*test_guards.py:\d+.*torch.rand"):
        graph(*_data(0))


class MaybeMask(nn.Module):
    """A library's habit: `isinstance(mask, torch.Tensor)` decides the branch."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(D, C)

    def forward(self, x, mask=None):
        out = self.l1(x)
        if isinstance(mask, torch.Tensor):
            out = out.masked_fill(~mask.bool(), 0.0)
        return out


class MaskGraph(graphc.Graph):
    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.add_optimizer(opt)

    def build(self, x, y, mask):
        loss = F.cross_entropy(self.model(x, mask), y)
        loss.backward()
        return loss


def test_isinstance_tensor_branch_follows_eager():
    torch.manual_seed(0)
    model = MaybeMask()
    ref = copy.deepcopy(model)
    graph = MaskGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(0)
    mask = torch.rand(B, C) > 0.3
    loss = graph(x, y, mask).to_local().item()
    want = F.cross_entropy(ref(x, mask), y).item()
    assert abs(loss - want) < 1e-10, (loss, want)


def test_fingerprint_compares_plain_objects_by_value():
    a, b = Cfg(0.1), Cfg(0.1)
    assert fingerprint(a) == fingerprint(b)
    b.aux_weight = 0.2
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(float("nan")) == fingerprint(float("nan"))
    t = torch.zeros(2)
    assert fingerprint(t) != fingerprint(torch.zeros(2))  # tensors by identity


class ModeNet(nn.Module):
    """A deterministic mode switch (HF's `if self.training:`), and an annealed temperature."""

    def __init__(self):
        super().__init__()
        self.stage0 = nn.Sequential(nn.Linear(D, 8), nn.Tanh())
        self.stage1 = nn.Linear(8, C)
        self.tau = 1.0

    def forward(self, x):
        h = self.stage0(x)
        h = h * 2.0 if self.training else h * 0.5
        return self.stage1(h) / self.tau


class LayoutGraph(graphc.Graph):
    def __init__(self, model, opt, layout):
        super().__init__()
        self.model = model
        if layout == "pipeline":
            self.model.stage0.config.set_stage(0, graphc.placement("cpu", [0]))
            self.model.stage1.config.set_stage(1, graphc.placement("cpu", [1]))
            self.config.set_gradient_accumulation_steps(2)
        else:  # tensor parallel: stage0's Linear by output features, stage1's by input features
            where = graphc.placement("cpu", [0, 1])
            graphc.to_global(model, placement=where, sbp=graphc.sbp.broadcast)
            graphc.to_global(model.stage0[0], placement=where, sbp=graphc.sbp.split(0))
            graphc.to_global(model.stage1.weight, placement=where, sbp=graphc.sbp.split(1))
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


MODE_STEPS = [("train", 1.0), ("eval", 1.0), ("eval", 0.5), ("train", 0.5), ("train", 1.0)]


def _layout_worker(rank, world, layout):
    torch.manual_seed(0)
    model = ModeNet()
    ref = copy.deepcopy(model)
    graph = LayoutGraph(model, torch.optim.Adam(model.parameters(), lr=0.01), layout)
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    losses, want = [], []
    for step, (mode, tau) in enumerate(MODE_STEPS):
        x, y = _data(step)
        for m in (model, ref):
            m.train(mode == "train")
            m.tau = tau
        loss = graph(x, y).to_local()  # empty on a rank without the loss's stage
        losses.append(loss.item() if loss.numel() else None)
        want.append(_eager_step(ref, opt, x, y, 0.0))
    state = {k: v.clone() for k, v in graph.full_state_dict().items()}
    return losses, want, state, ref.state_dict(), graph.recompiles


@pytest.mark.world
@pytest.mark.parametrize("layout", ["pipeline", "tensor"])
def test_mode_switch_and_annealing_under_pipeline_and_tensor_parallel(layout):
    results = run_world(_layout_worker, 2, layout)
    assert any(r[0][0] is not None for r in results)  # some rank holds the loss
    for losses, want, state, want_state, recompiles in results:
        if losses[0] is not None:
            assert_close(torch.tensor(losses), torch.tensor(want), f"{layout}: losses")
        for k, v in want_state.items():
            assert_close(state[k], v, f"{layout}: {k}")
        # 4 settings: (train, 1), (eval, 1), (eval, .5), (train, .5); (train, 1) is reused
        assert len(recompiles) == 3, recompiles


class ScaledNet(BNNet):
    scale = 1.0  # a class attribute a user changes between calls (ScaledNet.scale = 0.5)

    def forward(self, x):
        return super().forward(x) * self.scale


class ScaledGraph(TrainGraph):
    aux = 0.0  # a Graph class attribute read by build()

    def build(self, x, y):
        out = self.model(x)
        loss = F.cross_entropy(out, y) + self.aux * out.square().mean()
        loss.backward()
        return loss


def test_class_attributes_are_guarded(monkeypatch):
    torch.manual_seed(0)
    model = ScaledNet()
    graph = ScaledGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(0)
    graph(x, y)
    monkeypatch.setattr(ScaledNet, "scale", 0.5)
    monkeypatch.setattr(ScaledGraph, "aux", 0.25)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        out = ref(x)
        want = F.cross_entropy(out, y) + 0.25 * out.square().mean()
    assert abs(graph(x, y).to_local().item() - want.item()) < 1e-10
    assert "model.scale changed (compiled for 1.0, now 0.5)" in graph.recompiles[-1]
