"""Module hooks and post-accumulate-grad hooks mean on every layout what they mean in eager
(NOTE: Module hooks, graphc/passes/traced_hooks.py; NOTE: Post-accumulate-grad hooks,
graphc/runtime/grad_hooks.py), over the layout matrix (tests/layouts.py) against a plain
eager loop on the whole batch, float64 at 1e-10 (helpers.assert_close). Gradient
accumulation 2, so a hook that fired per micro-batch would show.
"""
import threading

import pytest
import torch
import torch.nn as nn

import graphc
from graphc.errors import GraphcError
from helpers import assert_close
from layouts import Pair, SquaredError, assert_same, batches, declare, eager, every_layout, every_layout_slow_on, train

ACCUMULATION = 2


def _batches(n=3, batch=8):
    return batches(n, rows=batch)


def Train(model, layout):
    return SquaredError(model, layout, accumulation=ACCUMULATION)


def _compare(layout, make_model, between=None):
    """graphc on `layout` and eager, both from make_model() under seed 0, give the same
    losses and state; `between(model, step)` runs before each step on the raw module."""
    batches = _batches()
    torch.manual_seed(0)
    want = eager(make_model(), batches, between=between)

    def make_graph(layout):
        torch.manual_seed(0)
        return Train(make_model(), layout)

    got = train(layout, make_graph, batches,
                between=None if between is None else lambda g, step: between(g.model.origin, step))
    assert_same(got, want, layout)


def _double_output(module, args, out):
    return out * 2


def _shift_input(module, args):
    return (args[0] + 1,)


def _hooked():
    m = Pair()
    m.a.register_forward_hook(_double_output)
    m.b.register_forward_pre_hook(_shift_input)
    return m


@every_layout
def test_forward_hook_and_pre_hook(layout):
    _compare(layout, _hooked)


def _hooked_with_kwargs():
    m = Pair()
    m.a.register_forward_pre_hook(lambda mod, args, kwargs: ((args[0] * 0.5,), kwargs), with_kwargs=True)
    m.b.register_forward_hook(lambda mod, args, kwargs, out: out - args[0].sum(-1, keepdim=True),
                              with_kwargs=True)
    return m


@every_layout
def test_hooks_with_kwargs(layout):
    _compare(layout, _hooked_with_kwargs)


def _hook_from_step_one(model, step):
    if step == 1:  # after the first call: another plan, with the hook in it
        model.a.register_forward_hook(_double_output)
    if step == 2:  # on the model itself, which the trace goes through (not a leaf)
        model.register_forward_pre_hook(_shift_input)


# pp2xdp2 -m slow (5.7 s at load 7): a hook change's recompile on all four ranks of that layout
# is test_hook_removed_after_first_call[pp2xdp2]; this test's own pp2 and dp2 stay default
@every_layout_slow_on("pp2xdp2")
def test_hook_registered_after_first_call(layout):
    _compare(layout, Pair, _hook_from_step_one)


_HANDLES = {}


def _hooked_until_step_one():
    m = _hooked()
    _HANDLES[id(m)] = [m.a.register_forward_pre_hook(_shift_input)]
    return m


def _remove_at_step_one(model, step):
    if step == 1:
        for h in _HANDLES.pop(id(model)):
            h.remove()


@every_layout
def test_hook_removed_after_first_call(layout):
    _compare(layout, _hooked_until_step_one, _remove_at_step_one)


def test_recompile_names_the_hooks():
    """A hook added after compile is a recompile whose reason names the module's hooks."""
    torch.manual_seed(0)
    graph = Train(Pair(), "one")
    x, y = _batches(1)[0]
    graph(x, y)
    graph.model.b.register_forward_hook(_double_output)
    graph(x, y)
    assert len(graph._cache.recompiles) == 1 and "model.b hooks" in graph._cache.recompiles[0]


# -- post-accumulate-grad hooks ----------------------------------------------------------

class _GradRecorder:
    """A post-accumulate-grad hook: records the gradient's norm per thread (a rank of the
    local world, or eager's) and halves the gradient in place."""

    def __init__(self):
        self.norms = {}

    def __call__(self, p):
        self.norms.setdefault(threading.get_ident(), []).append(p.grad.norm().item())
        p.grad.mul_(0.5)


@every_layout
def test_post_accumulate_grad_hook_once_per_step(layout):
    recorder = _GradRecorder()

    def make_model():
        m = Pair()
        m.b.bias.register_post_accumulate_grad_hook(recorder)   # whole on every layout but ZeRO-3
        return m

    if layout == "zero3":
        with pytest.raises(GraphcError, match="ZeRO shards its gradient"):
            _compare(layout, make_model)
        return
    _compare(layout, make_model)
    (want,) = [recorder.norms.pop(threading.get_ident())]   # eager ran on this thread
    assert len(want) == 3 and recorder.norms, layout
    for norms in recorder.norms.values():   # every rank holding model.b: once per step, eager's
        assert_close(torch.tensor(norms), torch.tensor(want), f"{layout}: grad norms at the hook")


def test_post_accumulate_grad_hook_on_a_tensor_parallel_shard_is_refused():
    def make_model():
        m = Pair()
        m.a.weight.register_post_accumulate_grad_hook(_GradRecorder())
        return m
    with pytest.raises(GraphcError, match="model.a.weight.*tensor parallel"):
        _compare("tp2", make_model)


# -- refusals ---------------------------------------------------------------------------

def test_backward_hook_is_refused_naming_the_line():
    model = Pair()
    model.b.register_full_backward_hook(lambda mod, gin, gout: None)
    graph = Train(model, "one")
    with pytest.raises(GraphcError, match=r"'model.b'.*layouts.py:\d+.*backward hook \(<lambda> defined at .*test_hooks.py:\d+"):
        graph(*_batches(1)[0])


def test_global_module_hook_is_refused():
    handle = nn.modules.module.register_module_forward_hook(lambda mod, args, out: None)
    try:
        with pytest.raises(GraphcError, match="global module hooks.*register_forward_hook"):
            Train(Pair(), "one")(*_batches(1)[0])
    finally:
        handle.remove()
