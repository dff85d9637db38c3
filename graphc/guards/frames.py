"""What the frames of a trace read from outside the traced tensors (NOTE: Frame reads)."""
from __future__ import annotations

import dis
import functools
import gc
import os
import sys
import sysconfig
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.nn as nn

from .values import _PLAIN, MISSING, Guard, _entry_reader, fingerprint

# NOTE: Frame reads
# record_reads sees attribute reads of modules; a trace also depends on what the code it runs
# reads from outside any module: a module-level global (`SCALE`, `CFG.aux_weight`, a global
# function), a closure cell, an attribute of a user's own Python module (`config.LR`).
# TorchDynamo sees these because it runs the bytecode itself; graphc's tracer runs the user's
# code natively, so while tracing it observes every Python frame that starts (sys.settrace,
# 'call' events only: no per-line cost) and reads the frame's code once per code object: the
# names it loads with LOAD_GLOBAL (and the attribute chain after one), the free variables it
# loads with LOAD_DEREF, and the defaults of the function it runs (`def aux(out, w=0.1)`, whose
# `__defaults__` a user may set between calls). Each is guarded where it lives (the frame's
# globals dict, the function's cell, the function):
# - frames of torch, graphc and the standard library are skipped (their globals are torch's
#   machinery, not the user's settings);
# - in the user's code (outside site-packages) plain values, containers of them and objects
#   of the user's own classes compare by value (fingerprint); functions, classes and other
#   objects by identity; a global that names one of the user's Python modules guards the
#   attributes read off it;
# - in libraries (transformers, peft, torchvision) plain values by value, anything else by
#   identity: their module-level registries and caches change as they run; their closures
#   are decorators' wrappers (cells holding functions) and are not read.
# A global read many times (by every layer) is one guard. Frames of an op the tracer runs on
# fake tensors are not observed (frames_unobserved: the op runs again every step), and a
# code object read once is one dict lookup after: the trace costs 15-40% more (HF Llama, 4
# layers: 0.45 -> 0.59 s to compile; a trace function observing everything made it 2.3x).
_OWN_DIRS = tuple(os.path.realpath(p) + os.sep for p in {
    os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})   # torch, graphc
_LIBRARY_DIRS = tuple(os.path.realpath(p) + os.sep for p in {
    sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
_STDLIB_DIRS = tuple(os.path.realpath(p) + os.sep for p in {
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})


def _kind_of(path: str) -> str:
    """'skip' (torch, graphc, the standard library), 'library' (site-packages) or 'user'.
    site-packages may lie inside the standard library's folder: it is asked first."""
    if path.startswith(("<frozen", "<string>")):
        return "skip"
    real = os.path.realpath(path) if not path.startswith("<") else path
    if real.startswith(_OWN_DIRS):
        return "skip"
    if real.startswith(_LIBRARY_DIRS):
        return "library"
    return "skip" if real.startswith(_STDLIB_DIRS) else "user"


_LOAD_GLOBAL = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_LOAD_DEREF = frozenset({"LOAD_DEREF", "LOAD_CLASSDEREF"})


@dataclass(frozen=True)
class _CodeReads:
    """What one code object can read from outside its frame."""
    kind: str                                 # "skip", "user" or "library" (by its file)
    globals: Tuple[str, ...]                  # names loaded with LOAD_GLOBAL
    attributes: Tuple[Tuple[str, str], ...]   # (global, attribute) for `glob.attr`
    cells: Tuple[str, ...]                    # free variables loaded with LOAD_DEREF


_CODE_READS: Dict[Any, _CodeReads] = {}


def _code_reads(code) -> _CodeReads:
    found = _CODE_READS.get(code)
    if found is not None:
        return found
    kind = _kind_of(code.co_filename)
    if kind == "skip":
        found = _CodeReads(kind, (), (), ())
    else:
        names, attrs, cells = [], [], []
        previous = None
        for ins in dis.get_instructions(code):
            if ins.opname in _LOAD_GLOBAL:
                names.append(ins.argval)
            elif ins.opname in _LOAD_DEREF and ins.argval in code.co_freevars:
                cells.append(ins.argval)
            elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and previous is not None \
                    and previous.opname in _LOAD_GLOBAL:
                attrs.append((previous.argval, ins.argval))
            previous = ins
        found = _CodeReads(kind, tuple(dict.fromkeys(names)), tuple(dict.fromkeys(attrs)),
                           tuple(dict.fromkeys(cells)))
    _CODE_READS[code] = found
    return found


def _fx_patched(value: Any) -> bool:
    """Is `value` fx's stand-in for a global while it traces (torch.fx.wrap, math autowrap)?
    fx marks it inside its _Patcher class, so the attribute's name is mangled."""
    return hasattr(value, "_Patcher__fx_already_patched") or hasattr(value, "__fx_already_patched")


def _user_module(value: Any) -> bool:
    """A Python module of the user's own (a config.py), whose attributes are settings."""
    path = getattr(value, "__file__", None)
    return isinstance(value, types.ModuleType) and bool(path) and _kind_of(path) == "user"


def _by_value(value: Any, kind: str) -> bool:
    """Is a value read from outside the frame compared by value (else by identity)?"""
    if isinstance(value, _PLAIN) or isinstance(value, functools.partial):
        return True
    if kind != "user" or callable(value) or isinstance(value, (torch.Tensor, nn.Module, types.ModuleType)):
        return False
    if isinstance(value, (tuple, list, dict, set, frozenset)):
        return True
    module = getattr(type(value), "__module__", "") or ""
    return not module.startswith(("torch", "builtins", "logging", "threading", "collections"))


class FrameReads:
    """The globals, module attributes and closure cells read by the frames that ran while
    tracing (NOTE: Frame reads), each to become one Guard."""

    def __init__(self):
        self.guards: Dict[Tuple[int, str], Guard] = {}
        self._closures: Dict[Any, list] = {}   # code -> the functions made from it
        self._done: Dict[Any, int] = {}   # code -> id(globals) read already (nothing new to read)

    def observe(self, frame) -> None:
        reads = _code_reads(frame.f_code)
        if reads.kind == "skip":
            self._done[frame.f_code] = id(frame.f_globals)
            return
        where = f"{os.path.basename(frame.f_code.co_filename)}"
        scope = frame.f_globals
        for name in reads.globals:
            key = (id(scope), name)
            if key in self.guards or name not in scope:   # a builtin, or a name not set
                continue
            value = scope[name]
            if isinstance(value, types.ModuleType) or _fx_patched(value):
                continue   # a module is code (`module.attr` below); fx's own patch of a global
                # (a torch.fx.wrap'd function, math's autowrapped ones) is undone after the trace
            self.guards[key] = self._guard(f"global {name} ({where})", _entry_reader(scope, name), value,
                                           reads.kind, (scope, name))
        for name, attr in reads.attributes:
            module = scope.get(name)
            key = (id(module), attr)
            if key in self.guards or not _user_module(module) or attr not in vars(module):
                continue
            self.guards[key] = self._guard(f"{module.__name__}.{attr} ({where})", _entry_reader(vars(module), attr),
                                           vars(module)[attr], "user", (vars(module), attr))
        if reads.kind == "user":
            self._observe_defaults(frame, where)
        if reads.cells and reads.kind == "user":
            self._observe_cells(frame, reads, where)
        else:   # a library's closures are its decorators' wrappers: their cells hold functions
            self._done[frame.f_code] = id(scope)

    def _observe_cells(self, frame, reads: _CodeReads, where: str) -> None:
        """The free variables' cells: found on the function the frame runs (the function
        made from this code whose cells hold the frame's values)."""
        code = frame.f_code
        functions = self._closures.get(code)
        if functions is None:
            functions = self._closures[code] = [f for f in gc.get_referrers(code)
                                                if isinstance(f, types.FunctionType) and f.__closure__]
        values = frame.f_locals
        for fn in functions:
            cells = dict(zip(code.co_freevars, fn.__closure__))
            if all(name in values and _cell_value(cells[name]) is values[name] for name in reads.cells):
                break
        else:
            return   # made while tracing (a function defined in forward): its cells hold traced values
        for name in reads.cells:
            cell = cells[name]
            key = (id(cell), "")
            if key not in self.guards:
                self.guards[key] = self._guard(f"closure variable {name} of {code.co_name} ({where})",
                                               functools.partial(_cell_value, cell), _cell_value(cell),
                                               reads.kind)

    def _observe_defaults(self, frame, where: str) -> None:
        """The default values of the function the frame runs (`def aux(out, w=0.1)`): a call
        that leaves `w` out reads `aux.__defaults__`, which the user may set between calls."""
        fn = _function_of(frame)
        if fn is None:
            return
        for attr in ("__defaults__", "__kwdefaults__"):
            key = (id(fn), attr)
            if key not in self.guards and getattr(fn, attr) is not None:
                self.guards[key] = self._guard(f"{attr} of {fn.__qualname__} ({where})",
                                               functools.partial(getattr, fn, attr), getattr(fn, attr), "user")

    @staticmethod
    def _guard(where: str, read: Callable[[], Any], value: Any, kind: str, source: Optional[tuple] = None) -> Guard:
        if _by_value(value, kind):
            return Guard(where, read, fingerprint(value), source=source)
        return Guard(where, read, ("id", id(value)), same=value, source=source)

    def tracer(self) -> Callable:
        """The trace function (sys.settrace): a frame whose code was read already costs one
        dict lookup; no line events anywhere. (A trace sees ~50k frames a layer of HF Llama.)"""
        done, observe = self._done, self.observe

        def trace(frame, event, arg):
            if event == "call" and done.get(frame.f_code) != id(frame.f_globals):
                observe(frame)
        return trace


def _function_of(frame) -> Optional[types.FunctionType]:
    """The function a frame runs, found by its qualified name from the frame's globals (a
    module's function, a class's method); None for a function defined inside another (a
    closure: its cells are guarded) or one not reachable so."""
    code = frame.f_code
    parts = code.co_qualname.split(".")
    if "<locals>" in parts or parts[0] not in frame.f_globals:
        return None
    found = frame.f_globals[parts[0]]
    for part in parts[1:]:
        found = vars(found).get(part) if isinstance(found, type) else None
    found = getattr(found, "__func__", found)   # a staticmethod's or classmethod's function
    return found if isinstance(found, types.FunctionType) and found.__code__ is code else None


def _cell_value(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:   # an empty cell
        return MISSING


@contextmanager
def observe_frames(reads: Optional["FrameReads"] = None) -> Iterator["FrameReads"]:
    """While active, every Python frame this thread starts is read by a FrameReads (NOTE:
    Frame reads). A trace function set before (a debugger, coverage) keeps running."""
    reads = FrameReads() if reads is None else reads
    previous = sys.gettrace()
    own = reads.tracer()
    tracer = own

    def chained(frame, event, arg):   # a debugger's or coverage's tracer goes on
        own(frame, event, arg)
        return previous(frame, event, arg)
    if previous is not None:
        tracer = chained
    sys.settrace(tracer)
    try:
        yield reads
    finally:
        sys.settrace(previous)


@contextmanager
def frames_unobserved() -> Iterator[None]:
    """Around an op the tracer runs on fake tensors (BuildTracer._run_fake): no frame read.
    The op runs again on every step (its Python, a custom Function's forward, included), so
    what it reads needs no guard, and the fake-tensor machinery below it is most of a
    trace's frames (observing them tripled the compile time)."""
    tracer = sys.gettrace()
    if tracer is None:
        yield
        return
    sys.settrace(None)
    try:
        yield
    finally:
        sys.settrace(tracer)
