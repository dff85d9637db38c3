"""Every Python value build() reads is guarded, whatever the path (NOTE: Frame reads,
graphc/guards/frames.py): a module-level global, a closure variable, a functools.partial's keywords,
an attribute of the user's own config module, a property, which parameters take gradients.
Each is changed between calls as a user would, on every layout of the matrix (NOTE: Layout
matrix, tests/layouts.py), and graphc must train as eager does on the whole batch (float64,
1e-10) by compiling a plan for the new value (or reusing the cached one)."""
import functools
import math
import importlib.util
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from graphc.guards import FrameReads, observe_frames
from layouts import Pair, SquaredError, assert_same, batches, eager, every_layout, every_layout_slow_on, sgd, train

SCALE = 2.0


def _check(layout, make_model, between, make_opt=sgd, recompiles=None):
    """make_model() trained with `between(model, step)` before each step, graphc against eager."""
    data = batches()
    torch.manual_seed(0)
    want = eager(make_model(), data, make_opt, between)

    def make_graph(layout):
        torch.manual_seed(0)
        return SquaredError(make_model(), layout, make_opt)
    graphs = []
    got = train(layout, make_graph, data, between=lambda g, step: between(g.model.origin, step),
                graphs=graphs)
    assert_same(got, want, layout)
    if recompiles is not None:
        for graph in graphs:
            assert len(graph.recompiles) == recompiles, graph.recompiles
    return graphs


class GlobalScaled(Pair):
    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * SCALE


def _set_scale(model, step):
    global SCALE
    SCALE = (1.0, 2.0, 2.0)[step]


@every_layout
def test_a_module_level_global_is_guarded(layout):
    graphs = _check(layout, GlobalScaled, _set_scale, recompiles=1)
    assert "global SCALE (test_frame_reads.py) changed (compiled for 1.0, now 2.0)" in graphs[0].recompiles[0]


def _closure_model():
    setting = {"shift": 0.0}

    class Shifted(Pair):
        def forward(self, x):
            return self.b(torch.tanh(self.a(x))) + setting["shift"]

    model = Shifted()
    model.setting = setting   # the test's handle on the cell's dict; forward reads the cell
    return model


def _closure_cell_model():
    shift = 0.0

    def shifted(h):
        return h + shift

    def set_shift(value):
        nonlocal shift
        shift = value

    model = Pair()
    model.forward = lambda x: shifted(model.b(torch.tanh(model.a(x))))
    model.set_shift = set_shift
    return model


# pp2xdp2 -m slow (9.5 s at load 7): a guarded read's recompile on all four ranks of that layout
# is test_a_module_level_global_is_guarded[pp2xdp2]; this test's own pp2 and dp2 stay default
@every_layout_slow_on("pp2xdp2")
def test_closure_variables_are_guarded(layout):
    _check(layout, _closure_model, lambda m, step: m.setting.update(shift=0.5 * step), recompiles=2)


def test_a_rebound_closure_cell_is_guarded():
    _check("one", _closure_cell_model, lambda m, step: m.set_shift(0.25 * step), recompiles=2)


class PartialAct(Pair):
    def __init__(self):
        super().__init__()
        self.act = functools.partial(F.leaky_relu, negative_slope=0.1)

    def forward(self, x):
        return self.b(self.act(self.a(x)))


@every_layout
def test_a_partials_keywords_edited_in_place_are_guarded(layout):
    def between(model, step):
        model.act.keywords["negative_slope"] = (0.1, 0.3, 0.3)[step]
    _check(layout, PartialAct, between, recompiles=1)


def test_the_users_config_module_is_guarded(tmp_path, monkeypatch):
    (tmp_path / "user_settings.py").write_text("GAIN = 1.0\n")
    spec = importlib.util.spec_from_file_location("user_settings", tmp_path / "user_settings.py")
    settings = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(settings)
    monkeypatch.setitem(sys.modules, "user_settings", settings)
    monkeypatch.setitem(globals(), "user_settings", settings)

    class Gained(Pair):
        def forward(self, x):
            return self.b(torch.tanh(self.a(x))) * user_settings.GAIN  # noqa: F821 - set above

    graphs = _check("one", Gained, lambda m, step: setattr(settings, "GAIN", (1.0, 3.0, 3.0)[step]),
                    recompiles=1)
    assert "user_settings.GAIN" in graphs[0].recompiles[0]


class Scaled(Pair):
    """A read-only property, as peft's LoRA layers read `active_adapters` in every forward."""

    def __init__(self):
        super().__init__()
        self._gain = 1.0

    @property
    def gain(self):
        return self._gain

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.gain


def test_a_property_holds_between_calls_and_follows_its_value():
    # unchanged: one plan for every call (it used to fail its guard on every call)
    _check("one", Scaled, lambda m, step: None, recompiles=0)
    _check("one", Scaled, lambda m, step: setattr(m, "_gain", (1.0, 0.5, 0.5)[step]), recompiles=1)


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


@every_layout
def test_freezing_and_unfreezing_a_layer_follows_eager(layout):
    # AdamW: a frozen layer must not even decay (it did on data-parallel and ZeRO-3 stages)
    def between(model, step):
        model.a.requires_grad_(step != 1)
    graphs = _check(layout, Pair, between, make_opt=_adamw, recompiles=1)
    assert "requires_grad of the parameters changed" in graphs[0].recompiles[0]
    assert "a.weight" in graphs[0].recompiles[0]


def test_a_replaced_global_function_compiles_its_own_plan():
    def between(model, step):
        model.fn = (torch.tanh, torch.sigmoid, torch.sigmoid)[step]

    class Swapped(Pair):
        def forward(self, x):
            return self.b(self.fn(self.a(x)))
    _check("one", Swapped, between, recompiles=1)


def test_frames_of_torch_and_graphc_are_not_read():
    with observe_frames() as reads:
        nn.Linear(2, 2)(torch.randn(1, 2))
    assert reads.guards == {}


def test_a_previous_trace_function_keeps_running():
    seen = []

    def tracer(frame, event, arg):
        seen.append(frame.f_code.co_name)

    def inner():
        return SCALE
    sys.settrace(tracer)
    try:
        with observe_frames() as reads:
            inner()
    finally:
        sys.settrace(None)
    assert "inner" in seen
    assert any("global SCALE" in g.where for g in reads.guards.values())


def test_library_objects_compare_by_identity():
    reads = FrameReads()
    guard = reads._guard("global REGISTRY", lambda: {"a": 1}, {"a": 1}, "library")
    assert guard.same is not None and not guard.holds()   # a new dict: identity differs
    guard = reads._guard("global REGISTRY", lambda: {"a": 1}, {"a": 1}, "user")
    assert guard.holds()


@torch.fx.wrap
def _wrapped_scale(x, gain: float):
    return x * gain


class FxPatched(Pair):
    def forward(self, x):   # fx swaps both globals for stand-ins while it traces
        return _wrapped_scale(self.b(torch.tanh(self.a(x))), sqrt(4.0))


sqrt = math.sqrt


def test_globals_fx_patches_while_tracing_need_no_recompile():
    # a torch.fx.wrap'd function and an autowrapped math function are fx's stand-ins during
    # the trace: their guard read the stand-in and failed on every call (a plan per call)
    _check("one", FxPatched, lambda m, step: None, recompiles=0)
