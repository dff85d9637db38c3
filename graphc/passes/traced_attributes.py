"""Attribute writes while tracing: a change that eager makes once per call is refused.

NOTE: Attribute writes
build() runs as Python once per trace (twice per compile with gradient accumulation: the
whole batch, then one micro-batch), never per step, so `self.step += 1` in build() or
`self.calls += 1` in a module's forward would count traces, not calls, and the guard on
the value read would then ask for another compile. A write that sets a value without
reading it first (`model.eval()`, `self.flag = True`, a lazily made attribute) leaves the
same state after every call, so after the first: it is allowed. A write that changes a
value the trace read before (a read-modify-write: a counter, a running average kept in a
Python number) is refused with the user's line and the fix: make the update outside
build(), after the graph call. The Graph's own attributes count as the traced root's
(build_root.py); a traced tensor stored on the Graph (`self.last = h`) would be a symbol
of the trace, never a step's value: refused too, with the fix (return it). graphc's own
bookkeeping on the root (fx's `_tensor_constant0`) is not a user's write.
"""
from __future__ import annotations

from typing import Any, Optional

import torch.fx as fx

from ..errors import GraphcError
from ..guards import MISSING, class_value, current_log, fingerprint
from .user_lines import deepest_user_frame, live_frames


def check_attribute_write(tracer, module, name: str, value: Any) -> None:
    """Refuses `module.name = value` while tracing when it changes a value the trace read."""
    if name == "training" or name.startswith("_tensor_constant") or tracer.running_fake:
        return
    if not any(module is m for m in tracer.known_modules()):
        return  # a module made during the step (its __init__), not the user's state
    owner, where = _owner(tracer, module, name)
    if module is tracer.trace_root and isinstance(value, fx.Proxy):
        line = deepest_user_frame(None, live_frames())
        raise GraphcError(
            f"build() stores a traced tensor in '{where}' at {line}: it would hold a symbol of "
            "the trace, not each step's value (eager sets it on every call). Fix: return it from "
            f"build() (`return loss, {name}`) and read it from the graph call's result.")
    old = _current(owner, name)
    if old is MISSING or isinstance(value, fx.Proxy) or fingerprint(old) == fingerprint(value):
        return
    log = current_log()
    if log is not None and (id(owner), name) not in log.reads:
        return  # set without being read: the same state after every call
    line = deepest_user_frame(None, live_frames())
    raise GraphcError(
        f"build() changes the Python attribute '{where}' from {_short(old)} to {_short(value)} at "
        f"{line}. build() is traced into a static graph (once per compile, twice with gradient "
        "accumulation), so this update would count traces, not calls, where eager makes it once "
        f"per call. Fix: move `{_code(line)}` out of build() (and out of the module's forward), "
        "after the graph call: `loss = graph(x, y); ...` followed by the update.")


def _current(obj, name: str) -> Any:
    """The value build() reads as obj.name, as the guards see it: the instance's, else a
    plain class attribute (`calls = 0` in the class body)."""
    if name in obj.__dict__:
        return obj.__dict__[name]
    value = getattr(type(obj), name, MISSING)
    return value if value is not MISSING and class_value(obj, name, value) else MISSING


def _owner(tracer, module, name: str):
    """The object that holds `name` (the Graph for the traced root's fallback attributes),
    and the name the user knows it by."""
    root = tracer.trace_root
    if module is root:
        graph = root.__dict__.get("_graphc_graph")
        if graph is not None and name not in root.__dict__ and _current(graph, name) is not MISSING:
            return graph, f"self.{name}"
        return module, f"self.{name}"
    holder = tracer.path_of_module(module)
    return module, f"{holder}.{name}" if holder else name


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _code(line: str) -> Optional[str]:
    return line.split(": ", 1)[-1].strip() if ": " in line else line
