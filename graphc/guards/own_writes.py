"""Values a trace wrote itself: a library that sets its own setting on its first call.

NOTE: Writes of the first call
A guard records the value a trace read first. Hugging Face's classification heads read
`config.problem_type` and, while it is None, set it from the labels on the first call
(`self.config.problem_type = "single_label_classification"`): the trace reads None and
leaves "single_label_classification", so every guard on the config failed at the second
call and compiled a second plan, for nothing. After compile, a guard that no longer holds
though nothing but the trace ran since names such a write. build() is then traced once more
with the values the trace left, as every later call sees them: the same graph (TraceText,
NOTE: Retrace check) means the plan serves them too, and those guards take the values now
(one more trace, only when a trace wrote what it read). Another graph keeps the guards as
they were, so the next call compiles its own plan, as eager would compute another thing;
a warning says which value build() changed and why a plan follows.
With gradient accumulation compile traces the whole batch first and the plan's micro-batch
after it, so the plan is already the graph of the value the first trace wrote. Where the
two traces' ops differ (CompiledGraph.whole_ops against the plan's) and the trace wrote a
value it read, the first call would run the new value's graph where eager runs the old
one's: refused, naming the value (first_call_differs).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List

import torch.fx as fx

from ..errors import GraphcError
from ..log import get_logger, warn_user
from .values import MISSING, Guard, GuardSet, difference, fingerprint

_log = get_logger("compile")


def refuse_traced_values_kept(name: str, guards: GuardSet) -> None:
    """Refuses a trace that left one of its traced values in Python state outside build() (a
    metric list: `self.history.append(loss.detach())`, a dict of last outputs): eager keeps
    each call's tensor there, the plan would keep the trace's stand-ins, once per trace, and
    every later call would find the value changed and compile again. An attribute assigned a
    traced value is refused where it is written (NOTE: Attribute writes); a container's own
    method (list.append) cannot be seen there, so the guards' values are read after the trace."""
    for guard in guards.guards:
        if guard.holds():
            continue
        value = guard.read()
        if _traced_count(value):
            raise GraphcError(
                f"{name}.build() put a traced value into {guard.where} while it was traced "
                f"(it now holds {_traced_count(value)} of the trace's stand-ins, not tensors): build() "
                "runs as a compiled plan, so Python code in it runs only while it is traced, never per "
                "call. Fix: return the value from build() and keep it after the call: "
                "`loss = graph(x, y); history.append(loss.to_local())`.")


def _traced_count(value, depth: int = 0) -> int:
    if isinstance(value, fx.Proxy):
        return 1
    if depth >= 4:
        return 0
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return sum(_traced_count(v, depth + 1) for v in list(value)[:256])
    return 0


def first_call_differs(name: str, guards: GuardSet, whole_ops, plan_ops) -> None:
    """Refuses a plan whose graph a value written by the whole batch's trace changed (See
    NOTE: Writes of the first call): eager's first call runs the graph before the write."""
    if whole_ops is None or whole_ops == plan_ops:
        return
    written = [g for g in guards.guards if not g.holds()]
    if not written:
        return
    at = next((i for i, (a, b) in enumerate(zip(whole_ops, plan_ops)) if a != b), min(len(whole_ops), len(plan_ops)))
    raise GraphcError(
        f"{name}.build() changed {_changes(written)} while it was traced for the whole batch, and "
        f"traced again for a micro-batch it took another path (op {at}: "
        f"{_op(whole_ops, at)} before the change, {_op(plan_ops, at)} after): under gradient "
        "accumulation the plan would run the changed graph at the first call, where eager runs "
        "the first. Fix: set the value before the first call (as the library would set it), or "
        "call with set_gradient_accumulation_steps(1) once.")


def _op(ops, i: int) -> str:
    return f"{ops[i][0]} {ops[i][1]}" if i < len(ops) else "the end"


def settle_own_writes(name: str, guards: GuardSet, traced, retrace: Callable[[], object]) -> GuardSet:
    """`guards` with the values the compile's own trace wrote re-recorded when build() traced
    again on them gives the same graph (See NOTE: Writes of the first call).

    Args:
        name: the Graph's class name, for the warning.
        guards: the guards compile recorded (values as the trace first read them).
        traced: the compiled graph's TraceText.
        retrace: traces build() again as compile did and returns its TraceText.
    """
    written = [g for g in guards.guards if not g.holds()]
    if not written or traced is None:
        return guards
    after = [fingerprint(g.read()) for g in written]
    found = traced.first_difference(retrace())
    if found is not None or after != [fingerprint(g.read()) for g in written]:
        warn_user(f"{name}.build() changed {_changes(written)} while it was traced (a library setting "
                  "its own value on its first call), and build() traced with the new value makes "
                  "another graph: the next call compiles a plan for it. Fix: set the value before "
                  "the first call.")
        return guards
    _log.info("%s: build() set %s on its first call; the plan serves the new value", name, _changes(written))
    settled = {id(g): _now(g) for g in written}
    return GuardSet(tuple(settled.get(id(g), g) for g in guards.guards))


def _now(guard: Guard) -> Guard:
    """The guard expecting the value it reads now."""
    value = guard.read()
    if guard.same is not MISSING:
        return dataclasses.replace(guard, same=value, expected=("id", id(value)))
    return dataclasses.replace(guard, expected=fingerprint(value))


def _changes(written: List[Guard]) -> str:
    """The values the trace wrote, in words: 'model.config.problem_type from None to ...'."""
    return ", ".join(_change(g) for g in written[:3]) + (f" and {len(written) - 3} more" if len(written) > 3 else "")


def _change(guard: Guard) -> str:
    if guard.same is not MISSING:   # a guard on identity: another object sits there
        return f"{guard.where} to another object"
    path, was, now = difference(guard.expected, fingerprint(guard.read()))
    return f"{guard.where}{path} from {was} to {now}"
