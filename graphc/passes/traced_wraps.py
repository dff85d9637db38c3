"""Functions marked `torch.fx.wrap`, traced through while build() is traced (`traced_wraps`).

NOTE: fx.wrap'd functions
`torch.fx.wrap("f")` asks torch.fx's symbolic tracer to keep `f` one opaque call, because
fx's tracer cannot follow its Python (torchvision marks `stochastic_depth`, Swin's shifted
window attention, MaxViT's partitions). graphc's tracer is not that tracer: it answers shape
questions from fake tensors, so most of those bodies trace as they are written. Kept opaque,
such a call has no SBP rule and gathers the batch under data parallelism: every layer after
EfficientNet's or ConvNeXt's first block ran on the whole batch on every rank, even at drop
probability 0. So while graphc traces, a wrapped function's body is traced through and its
ops get their own rules; only a body fx still cannot record (Python control flow on a tensor's
value: fx's TraceError) falls back to the one opaque call fx.wrap asked for, its partial
nodes erased. fx's patch table is read, never changed: the stand-in graphc puts in place for
its own trace defers to fx's stand-in for any other tracer.
"""
from __future__ import annotations

import builtins
import contextvars
from contextlib import contextmanager
from typing import Callable, Iterator

import torch.fx as fx
from torch.fx import _symbolic_trace as _fx

_TRACER: contextvars.ContextVar = contextvars.ContextVar("graphc_wrap_tracer", default=None)
_FX_PATCH = _fx._patch_wrapped_functions


def _patch_wrapped_functions(patcher) -> None:
    """fx's _patch_wrapped_functions, but for graphc's tracer each wrapped global's stand-in
    traces the body through (NOTE: fx.wrap'd functions)."""
    tracer = _TRACER.get()
    if tracer is None:
        return _FX_PATCH(patcher)
    for (_, name), frame_dict in _fx._wrapped_fns_to_patch.copy().items():
        fn = getattr(builtins, name) if name not in frame_dict and hasattr(builtins, name) else frame_dict[name]
        patcher.patch(frame_dict, name, _through(tracer, fn, _fx._create_wrapped_func(fn)))
    for cls, name in _fx._wrapped_methods_to_patch:
        patcher.patch_method(cls, name, _fx._create_wrapped_method(cls, name))


def _through(tracer, fn: Callable, opaque: Callable) -> Callable:
    def traced_through(*args, **kwargs):
        mark = tracer.graph._root.prev   # the last node before the call
        try:
            return fn(*args, **kwargs)
        except fx.proxy.TraceError:   # control flow on a value: the opaque call fx.wrap asked for
            _erase_after(tracer.graph, mark)
            return opaque(*args, **kwargs)
    traced_through.__wrapped__ = fn
    return traced_through


def _erase_after(graph: fx.Graph, mark: fx.Node) -> None:
    made = []
    node = mark.next
    while node is not graph._root:
        made.append(node)
        node = node.next
    for node in reversed(made):
        graph.erase_node(node)


@contextmanager
def traced_wraps(tracer) -> Iterator[None]:
    """While `tracer` traces in this thread (and context): fx.wrap'd functions traced through."""
    token = _TRACER.set(tracer)
    _fx._patch_wrapped_functions = _patch_wrapped_functions   # read by fx's Tracer.trace
    try:
        yield
    finally:
        _TRACER.reset(token)
