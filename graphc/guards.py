"""Guards: the Python values a compiled plan was built from, checked again on every call.

NOTE: Guards
build() is traced once into a static graph, so every Python value the trace read is a
constant of the plan: a module's `training` flag (dropout, BatchNorm, `if self.training:`),
a temperature `model.tau`, a Graph attribute `self.cfg.aux_weight`, which module or
parameter object sits at `model.head`. TorchDynamo keeps such values honest with guards;
graphc does the same for the values its own tracer reads (docs/design.md, "Guards", says
why the capture itself stays graphc's tracer):
- while compiling, nn.Module has a __getattribute__ (record_reads) that notes each
  attribute of a module's instance __dict__ that the code read, and each plain class
  attribute (`scale = 0.5` in the class body), with the value it had at its first read;
  the Graph's attributes are noted by the traced root's fallback lookup (build_root.py);
- plain values (numbers, strings, dtypes, tuples, dicts and small objects of them) are
  compared by value (`fingerprint`): a change selects, or compiles and caches, another
  plan (Executable lookup, like Dynamo's cache entries); tensors and other objects compare
  by identity;
- which module, parameter or buffer sits under each name (`structure_of`) and torch's
  global modes (grad, autocast, default dtype) are guarded too. A module or parameter
  replaced after compile cannot simply recompile (the optimizer and the shards hold the
  old parameters): it is a GraphcError saying so.
A check costs one dict lookup and a comparison per guarded value (docs/design.md gives
the measured cost per call).
"""
from __future__ import annotations

import dis
import enum
import functools
import gc
import math
import os
import sys
import sysconfig
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
          torch.Size, enum.Enum, type(Ellipsis), slice, range)
_MAX_ITEMS = 256   # a longer container compares by identity (its contents are data, not settings)
_MAX_DEPTH = 4
# what nn.Module.__init__ puts in every instance's __dict__: torch's bookkeeping, not settings
_MODULE_INTERNALS = frozenset(vars(nn.Module())) - {"training"}
MISSING = object()


def fingerprint(value: Any, depth: int = 0) -> Any:
    """A comparable summary of `value`: equal fingerprints mean the trace would read the same.

    Plain values by value (a float NaN by its text, so it equals itself), containers and
    small plain objects (a config) by their items, anything else (tensors, modules,
    functions, big containers) by identity.
    """
    if isinstance(value, _PLAIN):
        if isinstance(value, float) and math.isnan(value):
            return (float, "nan")
        return (type(value), value)
    if isinstance(value, functools.partial) and depth < _MAX_DEPTH:   # its func, args and keywords
        return (functools.partial, id(value.func), fingerprint(value.args, depth + 1),
                fingerprint(value.keywords, depth + 1))
    if depth >= _MAX_DEPTH or isinstance(value, (torch.Tensor, nn.Module)) or callable(value):
        return ("id", id(value))
    if isinstance(value, (tuple, list)) and len(value) <= _MAX_ITEMS:
        return (type(value), tuple(fingerprint(v, depth + 1) for v in value))
    if isinstance(value, (set, frozenset)) and len(value) <= _MAX_ITEMS:
        return (type(value), frozenset(fingerprint(v, depth + 1) for v in value))
    if isinstance(value, dict) and len(value) <= _MAX_ITEMS:
        return (type(value), tuple((fingerprint(k, depth + 1), fingerprint(v, depth + 1))
                                   for k, v in value.items()))
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict) and len(attrs) <= _MAX_ITEMS:
        return (type(value), tuple((k, fingerprint(v, depth + 1)) for k, v in attrs.items()))
    return ("id", id(value))


def describe(value: Any) -> str:
    """A short text of a guarded value for the recompile log."""
    text = repr(value) if isinstance(value, _PLAIN) else f"<{type(value).__name__} at {id(value):#x}>"
    return text if len(text) <= 60 else text[:57] + "..."


def difference(old: Any, new: Any, path: str = "") -> Tuple[str, str, str]:
    """Where two fingerprints first differ: (attribute path below the guarded value, the
    value compiled for, the value now), for the recompile log."""
    if (isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new) == 2
            and old[0] == new[0] and old[0] != "id" and isinstance(old[1], tuple)
            and isinstance(new[1], tuple) and len(old[1]) == len(new[1])):
        for i, (a, b) in enumerate(zip(old[1], new[1])):
            if a == b:
                continue
            if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str) and a[0] != "id" \
                    and isinstance(b, tuple) and len(b) == 2 and a[0] == b[0]:  # an attribute
                return difference(a[1], b[1], f"{path}.{a[0]}")
            return difference(a, b, f"{path}[{i}]")
    return path, _text(old), _text(new)


def _text(fp: Any) -> str:
    if isinstance(fp, tuple) and len(fp) == 2 and fp[0] != "id" and isinstance(fp[0], type) \
            and not isinstance(fp[1], tuple):
        return describe(fp[1])
    if isinstance(fp, tuple) and len(fp) == 2 and isinstance(fp[0], type):
        return f"a {fp[0].__name__}"
    return "another object"


@dataclass(frozen=True)
class Guard:
    """One value the plan depends on: `where` names it for the user ('model.drop.training')."""
    where: str
    read: Callable[[], Any]   # the value now (MISSING where the attribute is gone)
    expected: Any             # its fingerprint when traced
    replaceable: bool = True  # False: a change cannot compile another plan (see check)
    same: Any = MISSING       # the object itself, for a guard on identity (checked with `is`)
    detail: Optional[Callable[[Any], str]] = None   # the change in words, given `expected`
    # where `read` looks, for the compiled check (NOTE: Compiled guard check): (table, key)
    # for a dict entry, (table, key, cls) for an attribute: the instance's, else its class's
    source: Optional[tuple] = None

    def holds(self) -> bool:
        if self.same is not MISSING:
            return self.read() is self.same
        return fingerprint(self.read()) == self.expected


@dataclass
class GuardSet:
    """The guards of one compiled plan, in the order they were read."""
    guards: Tuple[Guard, ...] = ()

    def failing(self) -> Optional[Guard]:
        """The first guard that no longer holds, or None (the plan may run)."""
        check = self.__dict__.get("_check")
        if check is None:
            check = self.__dict__["_check"] = compiled_check(self.guards)
        i = check({})   # {}: one object read by many modules (an HF config) summed once a call
        return None if i < 0 else self.guards[i]

    def __len__(self) -> int:
        return len(self.guards)


# NOTE: Compiled guard check
# Every call of a graph checks every guard of its plan: with one guard per module attribute
# read and per parameter slot, a 32-layer model has ~1600. Walking them one Guard at a time
# (a reader call, a fingerprint, a tuple comparison each) cost ~30 us a layer. As Dynamo
# compiles its guards into one function, compiled_check writes the guards as one function
# of straight-line Python: a dict entry read inline (`d.get(key, M)`), an identity guard an
# `is`, a bool or None an `is`, an int, float or string a type check and `==`; only other
# values go through fingerprint (containers, configs: each object once per call). It returns
# the index of the first failing guard, -1 when all hold.
_INLINE_TYPES = (int, float, str)


def compiled_check(guards: Sequence[Guard]) -> Callable[[dict], int]:
    """One function checking `guards` in order (NOTE: Compiled guard check)."""
    # `type(v) in PT`, not isinstance: isinstance asks the object for __class__, which an HF
    # config answers through its own __getattribute__ (~1 us, 34 configs read per call)
    scope: Dict[str, Any] = {"M": MISSING, "fp": fingerprint, "PT": frozenset(_PLAIN) - {enum.Enum},
                             "id": id, "type": type, "getattr": getattr}
    lines = ["def check(seen):"]
    for i, g in enumerate(guards):
        if g.source is not None and len(g.source) == 2:
            scope[f"d{i}"], scope[f"k{i}"] = g.source
            lines.append(f"    v = d{i}.get(k{i}, M)")
        elif g.source is not None:
            scope[f"d{i}"], scope[f"k{i}"], scope[f"c{i}"] = g.source
            lines.append(f"    v = d{i}.get(k{i}, M)")
            lines.append(f"    if v is M: v = getattr(c{i}, k{i}, M)")
        else:
            scope[f"r{i}"] = g.read
            lines.append(f"    v = r{i}()")
        if g.same is not MISSING:
            scope[f"s{i}"] = g.same
            lines.append(f"    if v is not s{i}: return {i}")
            continue
        kind, raw = g.expected if isinstance(g.expected, tuple) and len(g.expected) == 2 else (None, None)
        if kind in (bool, type(None)):
            lines.append(f"    if v is not {raw!r}: return {i}")
        elif kind in _INLINE_TYPES and not (kind is float and math.isnan(raw)):
            scope[f"t{i}"], scope[f"x{i}"] = kind, raw
            lines.append(f"    if type(v) is not t{i} or v != x{i}: return {i}")
        else:
            scope[f"e{i}"] = g.expected
            lines.append(f"    if type(v) in PT: f = fp(v)")
            lines.append(f"    else:")   # kept with the value: a read's fresh tuple must not free its id
            lines.append(f"        s = seen.get(id(v))")
            lines.append(f"        if s is None: s = seen[id(v)] = (v, fp(v))")
            lines.append(f"        f = s[1]")
            lines.append(f"    if f != e{i}: return {i}")
    lines.append("    return -1")
    exec(compile("\n".join(lines), "<graphc guards>", "exec"), scope)  # noqa: S102 - generated above
    return scope["check"]


def global_guards() -> List[Guard]:
    """torch's process-wide modes that change what a trace records."""
    out = [Guard("torch.is_grad_enabled()", torch.is_grad_enabled, fingerprint(torch.is_grad_enabled())),
           Guard("torch.get_default_dtype()", torch.get_default_dtype, fingerprint(torch.get_default_dtype()))]
    for device in ("cpu", "cuda"):
        def state(device=device):   # a disabled region's dtype records nothing (graphc's own regions leave it set)
            on = torch.is_autocast_enabled(device)
            return (on, torch.get_autocast_dtype(device) if on else None)
        out.append(Guard(f"autocast state ({device})", state, fingerprint(state())))
    return out


def structure_of(root: nn.Module) -> List[Guard]:
    """Which module, parameter and buffer object sits under every name below root."""
    out = []
    for prefix, module in root.named_modules(remove_duplicate=False):
        for kind in ("_modules", "_parameters", "_buffers"):
            table = module.__dict__[kind]
            for name, obj in table.items():
                if obj is None:
                    continue
                where = f"{prefix}.{name}" if prefix else name
                out.append(Guard(where, _entry_reader(table, name), ("id", id(obj)), replaceable=False,
                                 same=obj, source=(table, name)))
    return out


# NOTE: Module hooks (passes/traced_hooks.py): the hooks a trace runs are part of the plan
FORWARD_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                       "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
BACKWARD_HOOK_TABLES = ("_backward_pre_hooks", "_backward_hooks")
# torch's process-wide module hooks, run on every module's call
GLOBAL_HOOK_TABLES = ("_global_forward_pre_hooks", "_global_forward_hooks",
                      "_global_backward_pre_hooks", "_global_backward_hooks")


def hook_guards(root: nn.Module) -> List[Guard]:
    """The forward and backward hooks of every module below root, and torch's global module
    hooks: one registered or removed after compile compiles another plan (NOTE: Module hooks).
    One guard for all modules: while none has a hook, its check is one any() over their hook
    dicts in C (one guard per module cost 0.4 us each, 120 us a call on a 32-layer Llama)."""
    tables = FORWARD_HOOK_TABLES + BACKWARD_HOOK_TABLES
    modules = [(prefix, module.__dict__) for prefix, module in root.named_modules()]
    dicts = [attrs[t] for _, attrs in modules for t in tables if t in attrs]

    def state():   # one line per hook (module, table, key, id): a string compares by value, however many
        if not any(dicts):
            return None
        return "\n".join(f"{prefix or 'the Graph'}|{t}|{key}|{id(fn)}" for prefix, attrs in modules
                         for t in tables for key, fn in (attrs.get(t) or {}).items())
    was = state()

    def detail(expected) -> str:
        before, now = set((was or "").splitlines()), set((state() or "").splitlines())
        changed = list(dict.fromkeys(row.split("|")[0] for row in sorted(before ^ now)))
        return ", ".join(f"{name} hooks" for name in changed[:4]) + (" and more" if len(changed) > 4 else "")
    out = [Guard("module hooks", state, fingerprint(was), detail=detail)]
    torch_hooks = vars(torch.nn.modules.module)
    out.append(Guard("torch's global module hooks", _hooks_reader(torch_hooks, GLOBAL_HOOK_TABLES),
                     fingerprint(hook_state(torch_hooks, GLOBAL_HOOK_TABLES))))
    return out


def hook_state(tables_of: Dict[str, Any], tables: Tuple[str, ...]) -> Optional[tuple]:
    """(table, ((key, id(hook)), ...)) per non-empty hook table, or None when all are empty
    (a plain value: an unhooked module's guard is one comparison)."""
    state = tuple((t, tuple((k, id(fn)) for k, fn in tables_of[t].items()))
                  for t in tables if tables_of.get(t))
    return state or None


def _hooks_reader(tables_of: Dict[str, Any], tables: Tuple[str, ...]) -> Callable[[], Any]:
    # torch registers and removes hooks in these dicts in place: an unhooked module's check
    # is one any() over them
    dicts = [tables_of[t] for t in tables if t in tables_of]
    return lambda: hook_state(tables_of, tables) if any(dicts) else None


def _entry_reader(table: dict, name: str) -> Callable[[], Any]:
    return lambda: table.get(name, MISSING)


def _descriptor(cls: type, name: str) -> Any:
    """The class's descriptor for `name` (a property), or None for a plain value."""
    found = next((c.__dict__[name] for c in cls.__mro__ if name in c.__dict__), None)
    return found if found is not None and hasattr(type(found), "__get__") else None


def _attr_source(obj: Any, name: str) -> Optional[tuple]:
    """Where _attr_reader looks, for the compiled check (None: through a descriptor)."""
    return None if _descriptor(type(obj), name) is not None else (obj.__dict__, name, type(obj))


def _attr_reader(obj: Any, name: str) -> Callable[[], Any]:
    """The attribute as Python finds it for a plain value: the instance's, else its class's;
    a property (or another descriptor of the class) is read through the object, as the
    trace read it (peft's `active_adapters`)."""
    attrs, cls = obj.__dict__, type(obj)
    if _descriptor(cls, name) is not None:
        def read():
            try:
                return object.__getattribute__(obj, name)
            except AttributeError:
                return MISSING
        return read
    return lambda: attrs[name] if name in attrs else getattr(cls, name, MISSING)


def class_value(obj: Any, name: str, value: Any) -> bool:
    """Is `value` a plain value found on the class (`class Block(nn.Module): scale = 0.5`, or
    a property's result), which the trace freezes like an instance attribute? Methods are code."""
    return (isinstance(value, _PLAIN) or isinstance(value, (tuple, list, dict, set, frozenset))) \
        and not name.startswith("__") and any(name in c.__dict__ for c in type(obj).__mro__)


class ReadLog:
    """The attributes read while tracing: (object, name) -> (where, fingerprint at first read)."""

    def __init__(self, names: Dict[int, str]):
        self.names = names  # id(module) -> its qualified name ('' for the root)
        self.reads: Dict[Tuple[int, str], Tuple[str, Any, Any]] = {}
        self.frames = FrameReads()   # what the traced frames read (NOTE: Frame reads)

    def note(self, obj: Any, name: str, value: Any, prefix: Optional[str] = None) -> None:
        key = (id(obj), name)
        if key in self.reads or isinstance(value, torch._subclasses.FakeTensor):
            return
        base = self.names.get(id(obj), "?") if prefix is None else prefix
        where = f"{base}.{name}" if base else name
        self.reads[key] = (where, obj, fingerprint(value))

    def guards(self) -> List[Guard]:
        return [Guard(where, _attr_reader(obj, name), fp, source=_attr_source(obj, name))
                for (_, name), (where, obj, fp) in self.reads.items()] + list(self.frames.guards.values())


_ACTIVE: List[ReadLog] = []


def _recording_getattribute(self, name: str):
    value = object.__getattribute__(self, name)
    if _ACTIVE and name not in _MODULE_INTERNALS:
        log = _ACTIVE[-1]
        if id(self) in log.names and (name in object.__getattribute__(self, "__dict__")
                                      or class_value(self, name, value)):
            log.note(self, name, value)
    return value


@contextmanager
def record_reads(root: nn.Module) -> Iterator[ReadLog]:
    """While active, attribute reads of every module below root are noted in the ReadLog.

    nn.Module gets a __getattribute__ for the duration (it has none of its own), so every
    module's type stays what it is: the passes' tables keyed by module type still match.
    """
    log = ReadLog({id(m): name for name, m in root.named_modules(remove_duplicate=True)})
    patched = "__getattribute__" not in nn.Module.__dict__
    if patched:
        nn.Module.__getattribute__ = _recording_getattribute
    _ACTIVE.append(log)
    try:
        yield log
    finally:
        _ACTIVE.remove(log)
        if patched:
            del nn.Module.__getattribute__


def current_log() -> Optional[ReadLog]:
    """The ReadLog of the trace in progress (None outside tracing)."""
    return _ACTIVE[-1] if _ACTIVE else None


# NOTE: Frame reads
# record_reads sees attribute reads of modules; a trace also depends on what the code it runs
# reads from outside any module: a module-level global (`SCALE`, `CFG.aux_weight`, a global
# function), a closure cell, an attribute of a user's own Python module (`config.LR`).
# TorchDynamo sees these because it runs the bytecode itself; graphc's tracer runs the user's
# code natively, so while tracing it observes every Python frame that starts (sys.settrace,
# 'call' events only: no per-line cost) and reads the frame's code once per code object: the
# names it loads with LOAD_GLOBAL (and the attribute chain after one), the free variables it
# loads with LOAD_DEREF. Each is guarded where it lives (the frame's globals dict, the
# function's cell):
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
    os.path.dirname(torch.__file__), os.path.dirname(os.path.abspath(__file__))})
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


def _cell_value(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:   # an empty cell
        return MISSING


@contextmanager
def traced_frames() -> Iterator[None]:
    """Around a trace of build(): the frames it runs are read into the compile's ReadLog
    (NOTE: Frame reads); nothing outside a compile. Only the trace is observed: a trace
    function on every call of the passes tripled the compile time."""
    log = current_log()
    if log is None:
        yield
        return
    with observe_frames(log.frames):
        yield


@contextmanager
def observe_frames(reads: Optional["FrameReads"] = None) -> Iterator["FrameReads"]:
    """While active, every Python frame this thread starts is read by a FrameReads (NOTE:
    Frame reads). A trace function set before (a debugger, coverage) keeps running."""
    reads = FrameReads() if reads is None else reads
    previous = sys.gettrace()
    tracer = own = reads.tracer()
    if previous is not None:
        def tracer(frame, event, arg):
            own(frame, event, arg)
            return previous(frame, event, arg)
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


def requires_grad_guard(root: nn.Module) -> Guard:
    """Which parameters below root take gradients (`requires_grad_(False)` freezes a layer,
    peft's set_adapter switches the trainable set): a change compiles another plan."""
    named = list(root.named_parameters())

    def read() -> bytes:   # plain, so compared by value however many parameters
        return bytes(p.requires_grad for _, p in named)

    def detail(expected) -> str:
        was = expected[1]
        flips = [f"{name} {'frozen' if was[i] else 'trainable'}"
                 for i, (name, p) in enumerate(named) if bool(was[i]) != p.requires_grad]
        return ", ".join(flips[:4]) + (f" and {len(flips) - 4} more" if len(flips) > 4 else "")
    return Guard("requires_grad of the parameters", read, fingerprint(read()), detail=detail)
