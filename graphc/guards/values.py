"""Guards' values: fingerprints, the Guard and GuardSet of a plan, and the compiled check
(NOTE: Guards, graphc/guards/__init__.py; NOTE: Compiled guard check)."""
from __future__ import annotations

import enum
import functools
import math
import operator
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
    """One function checking `guards` in order (NOTE: Compiled guard check): the grouped
    check first, and only where it finds a change, the guard-by-guard one to name it."""
    every = sequential_check(guards)
    holds = grouped_check(guards)

    def check(seen: dict) -> int:
        return -1 if holds(seen) else every(seen)
    return check


def sequential_check(guards: Sequence[Guard]) -> Callable[[dict], int]:
    """The index of the first guard that fails, -1 when all hold; guard by guard."""
    scope = _scope()
    lines = ["def check(seen):"]
    for i, g in enumerate(guards):
        lines += _guard_lines(i, g, scope, f"return {i}")
    lines.append("    return -1")
    return _function(lines, scope)


# NOTE: Grouped guard check
# Most guards of a model are entries of its modules' dicts: which child module and which
# parameter sits in each slot (`_modules`, `_parameters`: identity), the settings build()
# read from an instance's __dict__ (`training`, `eps`: a bool, number, string or None), and
# tuples of such values (a LayerNorm's normalized_shape: fingerprinting one costs ~2 us), and
# attributes found on the class because the instance's __dict__ lacks them (torch's
# `_compiled_call_impl`, read by every Module.__call__). Checked one by one, each costs a few
# bytecodes (~0.15 us; 1416 guards at 32 GPT layers). grouped_check checks each kind for all
# guards at once in C: `map(getitem, dicts, keys)` reads every entry, the identities compare
# by `any(map(is_not, ...))`, plain values (and tuples of them) as one tuple and their types
# as another; the class attributes as
# "no instance dict has the key" (`map(contains, ...)`) and each (class, name) once. The
# other guards (containers and configs by fingerprint, readers) run one by one as in
# sequential_check. It only says whether everything holds; on a change (a recompile, rare)
# sequential_check names the first guard that failed. Measured: benchmarks/guard_check.py.
def grouped_check(guards: Sequence[Guard]) -> Callable[[dict], bool]:
    """True when every guard holds (NOTE: Grouped guard check)."""
    same, plain, tuples, absent, on_class, rest = _vectors(guards)
    scope = _scope()
    scope.update(getitem=operator.getitem, contains=operator.contains, is_not=operator.is_not,
                 tuple=tuple, map=map, any=any,
                 SD=tuple(d for d, _, _ in same), SK=tuple(k for _, k, _ in same),
                 SO=tuple(o for _, _, o in same),
                 PD=tuple(d for d, _, _ in plain), PK=tuple(k for _, k, _ in plain),
                 PV=tuple(raw for _, _, (_, raw) in plain), PT_=tuple(kind for _, _, (kind, _) in plain),
                 TD=tuple(d for d, _, _ in tuples), TK=tuple(k for _, k, _ in tuples),
                 TV=tuple(raw for _, _, (raw, _) in tuples), TT=tuple(kinds for _, _, (_, kinds) in tuples),
                 TTS=(tuple,) * len(tuples), types_of=_types_of,
                 AD=tuple(d for d, _ in absent), AK=tuple(k for _, k in absent),
                 CC=tuple(c for c, _, _ in on_class), CK=tuple(k for _, k, _ in on_class),
                 CV=tuple(raw for _, _, (_, raw) in on_class), CT=tuple(kind for _, _, (kind, _) in on_class))
    lines = ["def holds(seen):",
             "    try:",
             "        if any(map(is_not, map(getitem, SD, SK), SO)): return False",
             "        v = tuple(map(getitem, PD, PK))",
             "        if v != PV or tuple(map(type, v)) != PT_: return False",
             "        v = tuple(map(getitem, TD, TK))",
             "        if v != TV or tuple(map(type, v)) != TTS or tuple(map(types_of, v)) != TT: return False",
             "        if any(map(contains, AD, AK)): return False",
             "        v = tuple(map(getattr, CC, CK))",
             "        if v != CV or tuple(map(type, v)) != CT: return False",
             "    except (KeyError, AttributeError):   # an entry gone: the one-by-one check names it",
             "        return False"]
    for i, g in rest:
        lines += _guard_lines(i, g, scope, "return False")
    lines.append("    return True")
    return _function(lines, scope)


def _vectors(guards: Sequence[Guard]):
    """The guards sorted by how grouped_check checks them: (dict, key, object) by identity,
    (dict, key, (type, value)) by value, (dict, key, (values, their types)) for a tuple of
    plain values (a LayerNorm's normalized_shape), (instance dict, key) that must lack the key with
    (class, key, (type, value)) once per pair, and the rest (index, guard) one by one."""
    same, plain, tuples, absent, rest = [], [], [], [], []
    on_class: Dict[tuple, tuple] = {}
    for i, g in enumerate(guards):
        table, key = (g.source[0], g.source[1]) if g.source is not None else (None, None)
        if table is not None and key in table and g.same is not MISSING:
            same.append((table, key, g.same))
        elif table is not None and key in table and _inline(g.expected):
            plain.append((table, key, g.expected))
        elif table is not None and key in table and (values := _plain_tuple(g.expected)) is not None:
            tuples.append((table, key, values))
        elif (table is not None and len(g.source) == 3 and g.same is MISSING and _inline(g.expected)
              and hasattr(g.source[2], key)):
            absent.append((table, key))
            on_class.setdefault((id(g.source[2]), key, g.expected), (g.source[2], key, g.expected))
        else:
            rest.append((i, g))
    return same, plain, tuples, absent, list(on_class.values()), rest


def _inline(expected: Any) -> bool:
    """A plain value compared inline: a bool, None, int, float (not NaN) or str."""
    if not (isinstance(expected, tuple) and len(expected) == 2):
        return False
    kind, raw = expected
    if kind in (bool, type(None)):
        return True
    return kind in _INLINE_TYPES and not (kind is float and math.isnan(raw))


def _plain_tuple(expected: Any) -> Optional[tuple]:
    """(values, their types) of a fingerprinted tuple of plain values, else None."""
    if not (isinstance(expected, tuple) and len(expected) == 2 and expected[0] is tuple):
        return None
    items = expected[1]
    if not all(_inline(item) for item in items):
        return None
    return tuple(raw for _, raw in items), tuple(kind for kind, _ in items)


def _types_of(values: tuple) -> tuple:
    return tuple(map(type, values))


def _scope() -> Dict[str, Any]:
    # `type(v) in PT`, not isinstance: isinstance asks the object for __class__, which an HF
    # config answers through its own __getattribute__ (~1 us, 34 configs read per call)
    return {"M": MISSING, "fp": fingerprint, "PT": frozenset(_PLAIN) - {enum.Enum},
            "id": id, "type": type, "getattr": getattr}


def _function(lines: List[str], scope: Dict[str, Any]) -> Callable:
    exec(compile("\n".join(lines), "<graphc guards>", "exec"), scope)  # noqa: S102 - generated above
    return scope[lines[0][4:lines[0].index("(")]]


def _guard_lines(i: int, g: Guard, scope: Dict[str, Any], fail: str) -> List[str]:
    """The lines checking guard i (names in `scope` suffixed by i); `fail` where it fails."""
    lines = []
    if g.source is not None and len(g.source) == 2:
        scope[f"d{i}_"], scope[f"k{i}"] = g.source
        lines.append(f"    v = d{i}_.get(k{i}, M)")
    elif g.source is not None:
        scope[f"d{i}_"], scope[f"k{i}"], scope[f"c{i}"] = g.source
        lines.append(f"    v = d{i}_.get(k{i}, M)")
        lines.append(f"    if v is M: v = getattr(c{i}, k{i}, M)")
    else:
        scope[f"r{i}"] = g.read
        lines.append(f"    v = r{i}()")
    if g.same is not MISSING:
        scope[f"s{i}"] = g.same
        return lines + [f"    if v is not s{i}: {fail}"]
    kind, raw = g.expected if isinstance(g.expected, tuple) and len(g.expected) == 2 else (None, None)
    if kind in (bool, type(None)):
        return lines + [f"    if v is not {raw!r}: {fail}"]
    if _inline(g.expected):
        scope[f"t{i}"], scope[f"x{i}"] = kind, raw
        return lines + [f"    if type(v) is not t{i} or v != x{i}: {fail}"]
    if _plain_tuple(g.expected) is not None:   # a tuple of plain values (an autocast state)
        scope[f"x{i}"], scope[f"t{i}"] = _plain_tuple(g.expected)
        return lines + [f"    if type(v) is not tuple or v != x{i} or tuple(map(type, v)) != t{i}: {fail}"]
    scope[f"e{i}"] = g.expected
    j = _matcher_index(g.expected, scope)
    if j is not None:   # an object by its attributes (NOTE: Object matchers)
        return lines + [f"    s = seen.get((id(v), {j}))",
                        f"    if s is None: s = seen[(id(v), {j})] = (v, m{j}(v) or fp(v) == e{i})",
                        f"    if not s[1]: {fail}"]
    return lines + ["    if type(v) in PT: f = fp(v)",
                    "    else:",   # kept with the value: a read's fresh tuple must not free its id
                    "        s = seen.get(id(v))",
                    "        if s is None: s = seen[id(v)] = (v, fp(v))",
                    "        f = s[1]",
                    f"    if f != e{i}: {fail}"]


# NOTE: Object matchers
# A guard on a small object compares its fingerprint (its attributes, recursively): an HF
# model's config (36 attributes) took ~35 us to fingerprint, and 34 modules of a 32-layer
# Llama each read the one shared config, each comparing the whole fingerprint. For an object
# fingerprinted by its attributes, the check instead builds once a matcher of that fingerprint:
# the same type, the same attribute names in the same order, the plain values (bool, None,
# int, float, str) compared as one tuple in C with their types, and only the other values
# fingerprinted. It says True only where fingerprint() would give the expected value (type
# for type, the same branches of fingerprint); where it says False the guard compares the
# fingerprint itself, so a matcher can make a check faster, never wrong. Guards expecting
# equal fingerprints share one matcher, and each (object, matcher) is matched once a call
# (`seen`), however many modules read it.
def _matcher_index(expected: Any, scope: Dict[str, Any]) -> Optional[int]:
    """The index j of the matcher `m{j}` in scope for `expected` (built on first use), or
    None when `expected` is not an object's attributes (NOTE: Object matchers)."""
    if not _is_attributes(expected):
        return None
    table = scope.setdefault("_matchers", {})
    key = expected
    try:
        hash(key)
    except TypeError:   # an unhashable plain value inside (a slice): a matcher of its own
        key = ("id", id(expected))
    if key not in table:
        table[key] = len(table)
        scope[f"m{table[key]}"] = attributes_matcher(expected)
    return table[key]


def _is_attributes(expected: Any) -> bool:
    """Whether `expected` is fingerprint()'s form of an object by its __dict__."""
    if not (isinstance(expected, tuple) and len(expected) == 2 and isinstance(expected[0], type)):
        return False
    kind, items = expected
    containers = (tuple, list, set, frozenset, dict, functools.partial)
    return (kind not in _PLAIN and not issubclass(kind, containers + (enum.Enum,)) and isinstance(items, tuple)
            and all(isinstance(it, tuple) and len(it) == 2 and isinstance(it[0], str) for it in items))


def attributes_matcher(expected: tuple) -> Callable[[Any], bool]:
    """True when fingerprint(v) == expected for an object fingerprinted by its attributes
    (False also where unsure: see NOTE: Object matchers)."""
    kind, items = expected
    names = tuple(k for k, _ in items)
    plain = [(k, fp) for k, fp in items if _inline(fp)]
    keys, values, types = tuple(k for k, _ in plain), tuple(fp[1] for _, fp in plain), tuple(fp[0] for _, fp in plain)
    others = tuple((k, _value_matcher(fp)) for k, fp in items if not _inline(fp))

    def matches(v: Any) -> bool:
        if type(v) is not kind:
            return False
        attrs = getattr(v, "__dict__", None)
        if type(attrs) is not dict or tuple(attrs) != names:
            return False
        now = tuple(map(attrs.__getitem__, keys))
        if now != values or tuple(map(type, now)) != types:
            return False
        return all(match(attrs[k]) for k, match in others)
    return matches


def _value_matcher(expected: Any) -> Callable[[Any], bool]:
    """For an attribute's fingerprint (at depth 1): a dict of plain keys and values compared
    in C (an HF config's id2label), anything else by its fingerprint."""
    if isinstance(expected, tuple) and len(expected) == 2 and expected[0] is dict \
            and all(_inline(k) and _inline(v) for k, v in expected[1]):
        pairs = expected[1]
        keys, key_types = tuple(k[1] for k, _ in pairs), tuple(k[0] for k, _ in pairs)
        values, value_types = tuple(v[1] for _, v in pairs), tuple(v[0] for _, v in pairs)
        return lambda d: (type(d) is dict and tuple(d) == keys and tuple(d.values()) == values
                          and tuple(map(type, d)) == key_types and tuple(map(type, d.values())) == value_types)
    return lambda value: fingerprint(value, 1) == expected


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
