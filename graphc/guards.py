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

import enum
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

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
    if depth >= _MAX_DEPTH or isinstance(value, (torch.Tensor, nn.Module)) or callable(value):
        return ("id", id(value))
    if isinstance(value, (tuple, list)) and len(value) <= _MAX_ITEMS:
        return (type(value), tuple(fingerprint(v, depth + 1) for v in value))
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
        # one object read by many modules (an HF config): summed once; kept with its fingerprint,
        # so a value made by a read (hook_state's tuples) cannot free its id for the next one
        seen: Dict[int, Tuple[Any, Any]] = {}
        for g in self.guards:
            value = g.read()
            if g.same is not MISSING:
                if value is not g.same:
                    return g
                continue
            if isinstance(value, _PLAIN):
                now = fingerprint(value)
            else:
                if id(value) not in seen:
                    seen[id(value)] = (value, fingerprint(value))
                now = seen[id(value)][1]
            if now != g.expected:
                return g
        return None

    def __len__(self) -> int:
        return len(self.guards)


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
                                 same=obj))
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
    hooks: one registered or removed after compile compiles another plan (NOTE: Module hooks)."""
    tables = FORWARD_HOOK_TABLES + BACKWARD_HOOK_TABLES
    out = [Guard(f"{prefix or 'the Graph'} hooks", _hooks_reader(module.__dict__, tables),
                 fingerprint(hook_state(module.__dict__, tables)))
           for prefix, module in root.named_modules()]
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


def _attr_reader(obj: Any, name: str) -> Callable[[], Any]:
    """The attribute as Python finds it for a plain value: the instance's, else its class's."""
    attrs, cls = obj.__dict__, type(obj)
    return lambda: attrs[name] if name in attrs else getattr(cls, name, MISSING)


def class_value(obj: Any, name: str, value: Any) -> bool:
    """Is `value` a plain class attribute (`class Block(nn.Module): scale = 0.5`), which the
    trace freezes like an instance attribute? Methods and other descriptors are code."""
    return isinstance(value, _PLAIN) and not name.startswith("__") and any(
        name in c.__dict__ for c in type(obj).__mro__)


class ReadLog:
    """The attributes read while tracing: (object, name) -> (where, fingerprint at first read)."""

    def __init__(self, names: Dict[int, str]):
        self.names = names  # id(module) -> its qualified name ('' for the root)
        self.reads: Dict[Tuple[int, str], Tuple[str, Any, Any]] = {}

    def note(self, obj: Any, name: str, value: Any, prefix: Optional[str] = None) -> None:
        key = (id(obj), name)
        if key in self.reads or isinstance(value, torch._subclasses.FakeTensor):
            return
        base = self.names.get(id(obj), "?") if prefix is None else prefix
        where = f"{base}.{name}" if base else name
        self.reads[key] = (where, obj, fingerprint(value))

    def guards(self) -> List[Guard]:
        return [Guard(where, _attr_reader(obj, name), fp)
                for (_, name), (where, obj, fp) in self.reads.items()]


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
