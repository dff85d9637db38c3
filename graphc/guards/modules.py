"""Guards on modules: the attributes a trace reads (record_reads), which object sits under
each name, the hook tables, which parameters train (NOTE: Guards)."""
from __future__ import annotations

import re

import operator
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from .frames import FrameReads, observe_frames
from .values import _MODULE_INTERNALS, _PLAIN, MISSING, Guard, _entry_reader, fingerprint

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

    def scan():   # one line per hook (module, table, key, id): a string compares by value, however many
        if not any(dicts):
            return None
        return "\n".join(f"{prefix or 'the Graph'}|{t}|{key}|{id(fn)}" for prefix, attrs in modules
                         for t in tables for key, fn in (attrs.get(t) or {}).items())
    was = scan()
    # NOTE: Hook registrations counted. Every hook torch registers (module, tensor, autograd
    # node) comes with a RemovableHandle, whose class counts them in next_id. While the count
    # has not moved since a scan found no hook, none has been registered since, so none is
    # there now (2,000 hook dicts at 32 GPT layers: 12.6 us a call, now one comparison). A
    # hook written into a module's dict by hand, without a handle, is not seen until the
    # next registration anywhere.
    quiet = [RemovableHandle.next_id if was is None else None]

    def state():
        if quiet[0] is not None and RemovableHandle.next_id == quiet[0]:
            return None
        now = scan()
        quiet[0] = RemovableHandle.next_id if now is None else None
        return now

    def detail(expected) -> str:
        before, now = set((was or "").splitlines()), set((scan() or "").splitlines())
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
        if key in self.reads or isinstance(value, torch._subclasses.FakeTensor) or _FX_CONSTANT.fullmatch(name):
            return   # (fx's tensor constants on the root are its bookkeeping, taken off after a trace)
        base = self.names.get(id(obj), "?") if prefix is None else prefix
        where = f"{base}.{name}" if base else name
        # a tensor, module or function compares by identity whatever its state: the guard
        # keeps the object and checks with `is`, in the grouped check's identity vector
        fp = fingerprint(value)
        by_identity = isinstance(value, (torch.Tensor, nn.Module)) or (
            callable(value) and fp[0] == "id")   # (a functools.partial compares by its parts)
        self.reads[key] = (where, obj, fp, value if by_identity else MISSING)

    def guards(self) -> List[Guard]:
        return [Guard(where, _attr_reader(obj, name), fp, same=same, source=_attr_source(obj, name))
                for (_, name), (where, obj, fp, same) in self.reads.items()] + list(self.frames.guards.values())


_ACTIVE: List[ReadLog] = []
_FX_CONSTANT = re.compile(r"_tensor_constant\d+")   # what fx names the tensor constants it keeps on the root


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


def requires_grad_guard(root: nn.Module) -> Guard:
    """Which parameters below root take gradients (`requires_grad_(False)` freezes a layer,
    peft's set_adapter switches the trainable set): a change compiles another plan."""
    named = list(root.named_parameters())
    flags = operator.attrgetter("requires_grad")
    params = [p for _, p in named]

    def read() -> bytes:   # plain, so compared by value however many parameters; read in C
        return bytes(map(flags, params))

    def detail(expected) -> str:
        was = expected[1]
        flips = [f"{name} {'frozen' if was[i] else 'trainable'}"
                 for i, (name, p) in enumerate(named) if bool(was[i]) != p.requires_grad]
        return ", ".join(flips[:4]) + (f" and {len(flips) - 4} more" if len(flips) > 4 else "")
    return Guard("requires_grad of the parameters", read, fingerprint(read()), detail=detail)


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
