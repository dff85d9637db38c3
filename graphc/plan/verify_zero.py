"""The plan verifier's ZeRO check (verify.py's check 5): one group per sharded gradient.

A ZeRO parameter's gradient is summed by one REDUCE_SCATTER over its group, the joint group of
every mesh axis it is partial over (See NOTE: ZeRO over joint axes in graphc/runtime/zero.py),
and its rows come back over that same group. A plan that also all-reduced it (over one of
its axes, as before ZeRO over joint axes) would sum it twice, or scatter rows a partial sum;
gathering it over another group would mix other ranks' rows. Each is refused, naming the
parameter and both groups.
"""
from __future__ import annotations

from typing import Callable, Dict, Set, Tuple

from .instructions import AllGather, AllReduce, ReduceScatter
from .plan import ZERO_NOTE, ExecutionPlan

Fail = Callable[[ExecutionPlan, int, str], None]


def check_zero_groups(plan: ExecutionPlan, fail: Fail, passed: Set[tuple]) -> None:
    """Calls fail(plan, index, why) at the first instruction of a ZeRO plan that reduces or
    gathers a sharded parameter other than over its one REDUCE_SCATTER's group. `passed`:
    the gradient collectives (by identity) of plans already checked, shared by the ranks of
    a group (insert_zero_sync makes them once for all of them): those are not checked again."""
    if ZERO_NOTE not in plan.notes:
        return
    key = tuple(id(ins) for ins in plan.instructions if type(ins) in (ReduceScatter, AllReduce)
                or isinstance(ins, AllGather))
    if key in passed:
        return
    group: Dict[str, Tuple[Tuple[int, ...], int]] = {}   # name -> (its scatter's ranks, where)
    for i, ins in enumerate(plan.instructions):
        if type(ins) is ReduceScatter:
            for t in ins.tensors:
                if t.name in group:
                    fail(plan, i, f"'{t.name}' is reduce-scattered a second time (first over ranks "
                         f"{list(group[t.name][0])} at #{group[t.name][1]}): one group per parameter")
                group[t.name] = (tuple(ins.ranks), i)
    for i, ins in enumerate(plan.instructions):
        if type(ins) is AllReduce or isinstance(ins, AllGather):
            for t in ins.tensors:
                if t.name in group and (type(ins) is AllReduce or tuple(ins.ranks) != group[t.name][0]):
                    fail(plan, i, _why(t.name, ins, group[t.name]))
    passed.add(key)


def _why(name: str, ins, scattered: Tuple[Tuple[int, ...], int]) -> str:
    ranks, at = scattered
    if type(ins) is AllReduce:
        return (f"'{name}' is reduce-scattered over ranks {list(ranks)} (#{at}) and all-reduced over "
                f"ranks {list(ins.ranks)} too: its gradient would be summed twice, or its rows "
                "scattered from a partial sum; a ZeRO gradient is reduced once, over the joint "
                "group of every axis it is partial over (insert_zero_sync)")
    return (f"'{name}' is gathered over ranks {list(ins.ranks)} but its rows were scattered over "
            f"ranks {list(ranks)} (#{at}): its rows come back over the group that holds them")
