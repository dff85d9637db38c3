"""Guards' values: fingerprints, the Guard and GuardSet of a plan, and the compiled check
(NOTE: Guards, graphc/guards/__init__.py; NOTE: Compiled guard check)."""
from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

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

    def text(self) -> str:
        """The guard as one check: `model.tau == 1.0`, `model.l2 is <Linear at 0x...>`."""
        if self.same is not MISSING:
            return f"{self.where} is {describe(self.same)}"
        return f"{self.where} == {shown(self.expected)}"


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

    def text(self) -> str:
        """The values the plan was compiled under, one check a line in the order every call
        checks them, as thunder prints a trace's prologue (NOTE: Guards). `graphc plan`
        writes it as guards.txt; `print(graph.compiled.guards)` shows the current plan's.

        Example:
            # 9 guards: the plan runs while every line holds (NOTE: Guards)
            torch.is_grad_enabled() == True
            model.tau == 1.0
        """
        head = f"# {len(self.guards)} guards: the plan runs while every line holds (NOTE: Guards)"
        return "\n".join([head] + [g.text() for g in self.guards])

    def __str__(self) -> str:
        return self.text()


def shown(fp: Any) -> str:
    """A fingerprint as the value it stands for: plain values by repr, containers and small
    objects by their items, what compares by identity as `<object at 0x...>`."""
    if not (isinstance(fp, tuple) and len(fp) >= 2):
        return repr(fp)
    kind, value = fp[0], fp[1]
    if kind == "id":
        return f"<object at {value:#x}>"
    if kind is float and value == "nan":
        return "nan"
    if kind in _PLAIN or (isinstance(kind, type) and issubclass(kind, enum.Enum)):
        return repr(value)
    if kind is functools.partial:
        return f"partial(<function at {value:#x}>, *{shown(fp[2])}, **{shown(fp[3])})"
    if issubclass(kind, (tuple, list)):
        items = ", ".join(shown(v) for v in value)
        return f"[{items}]" if issubclass(kind, list) else f"({items}{',' if len(value) == 1 else ''})"
    if issubclass(kind, (set, frozenset)):
        return "{" + ", ".join(sorted(shown(v) for v in value)) + "}"
    if issubclass(kind, dict):
        return "{" + ", ".join(f"{shown(k)}: {shown(v)}" for k, v in value) + "}"
    return f"{kind.__name__}(" + ", ".join(f"{k}={shown(v)}" for k, v in value) + ")"


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
            lines.append("    if type(v) in PT: f = fp(v)")
            lines.append("    else:")   # kept with the value: a read's fresh tuple must not free its id
            lines.append("        s = seen.get(id(v))")
            lines.append("        if s is None: s = seen[id(v)] = (v, fp(v))")
            lines.append("        f = s[1]")
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


def _entry_reader(table: dict, name: str) -> Callable[[], Any]:
    return lambda: table.get(name, MISSING)
