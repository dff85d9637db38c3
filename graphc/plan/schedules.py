"""Pipeline schedules as records: the registry, its checks and the queries over it.

Each schedule is a `Schedule` record in SCHEDULES: its name, its order function (a pure
function `(rank, num_ranks, num_stages, num_microbatches)` -> the instructions pipeline rank
`rank` computes, in order; the built-in ones are in plan/schedule_orders.py), its
LayoutFamily (plan/schedule_layouts.py: the layout and the stage count it needs), its own
check of the micro-batches and what describes it, so a new schedule touches one file (this
one, or its own calling `register_schedule`; See NOTE: Schedule registry).
`layout(schedule, p, num_stages)` says which stages each pipeline rank holds: one stage per
rank for gpipe and 1f1b, stage s on rank s mod p for the interleaved ones (interleaved_1f1b,
looped_bfs, zero_bubble), stages s and 2p-1-s on rank s for the V ones (zbv, dualpipev).
`check_schedule` applies the checks, `compute_order` gives a rank's order and
`pipeline_ranks` reads the user's placements as pipeline ranks; `peak_live` (re-exported
here, with the orders and the families) walks an order for the activations it keeps;
docs/schedules.md compares them. Communication is added later by lowering
(`passes/lower_plan.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from ..errors import GraphcError
from .instructions import Forward, Instruction
from .schedule_layouts import INTERLEAVED_LAYOUT, ONE_STAGE_LAYOUT, V_LAYOUT, LayoutFamily
from .schedule_orders import (ComputeOrder, dualpipev, gpipe, interleaved_1f1b, looped_bfs,
                              one_f_one_b, peak_live, zbv, zero_bubble)

# every name that lived here before the orders and families had files of their own
__all__ = ["ComputeOrder", "gpipe", "one_f_one_b", "interleaved_1f1b", "looped_bfs", "zero_bubble",
           "zbv", "dualpipev", "peak_live", "forward_only", "LayoutFamily", "ONE_STAGE_LAYOUT",
           "INTERLEAVED_LAYOUT", "V_LAYOUT", "Schedule", "SCHEDULES", "ONE_STAGE", "INTERLEAVED",
           "V_SHAPED", "register_schedule", "unregister_schedule", "stage_count", "accepts",
           "layout", "compute_order", "check_schedule", "pipeline_ranks"]


def forward_only(rank: int, num_ranks: int, num_stages: int, num_microbatches: int,
                 schedule: str = "interleaved_1f1b") -> List[Instruction]:
    """Inference: each chunk's forwards in micro-batch order, chunks in stage order; the
    chunks are those `schedule`'s layout gives the rank (a V for zbv and dualpipev)."""
    return [Forward(s, i) for s in layout(schedule, num_ranks, num_stages)[rank]
            for i in range(num_microbatches)]


# -- the schedules as records: name, order, layout family, check ------------------------

def _equal_rounds(where: str, p: int, m: int) -> None:
    if m % max(1, m // p):
        below = next(k for k in range(m, 0, -1) if _rounds_fit(p, k))
        above = next(k for k in range(m, 2 * m + 2 * p) if _rounds_fit(p, k))
        raise GraphcError(f"{where} runs micro-batches in max(1, m // p) rounds of equal size; "
                          f"found {m} micro-batches, which do not split into {m // p} equal "
                          f"rounds. Fix: config.set_gradient_accumulation_steps({below}) or "
                          f"({above}) (a multiple of {p} always works)")


def _microbatch_per_stage(where: str, p: int, m: int) -> None:
    if m < 2 * p:
        raise GraphcError(f"{where} needs at least as many micro-batches as stages, {2 * p}; "
                          f"found {m}. Fix: config.set_gradient_accumulation_steps({2 * p}) or "
                          "more, or choose 'zbv', which takes any number")


def _rounds_fit(num_ranks: int, num_microbatches: int) -> bool:
    return num_microbatches % max(1, num_microbatches // num_ranks) == 0


# NOTE: Schedule registry
# SCHEDULES is the one list of pipeline schedules. Everything that goes over "every
# schedule" reads it when it runs, not a copy: config.set_pipeline_schedule, the compiler,
# the bubble table (tools/bubbles.py), the docs' tables of schedules and of bubbles
# (tools/schedule_table.py, bubbles.markdown, checked against docs/schedules.md), the equivalence sweep (tests/local/sweep.py) and the plan
# tests. So a new schedule is one record here (or one `register_schedule` call in its own
# file), and every check picks it up. What a record cannot compute it states: the torch
# class with the same order (None where torch has none: no test may assume one), the
# preconditions and the peak-live formula as text for the docs, the paper's bubble where
# there is one.


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: its name (config.set_pipeline_schedule), each pipeline rank's
    compute order, the layout family of its stages, and what else it needs of the
    micro-batches (`check(where, p, m)`, after the family's check of the stages).

    The rest describes it (See NOTE: Schedule registry): `torch_class`, the
    torch.distributed.pipelining schedule with the same order (get_schedule_class's name,
    None if torch has none); `needs` and `peak`, the preconditions and rank r's peak live
    chunk-micro-batches as docs/schedules.md prints them; `textbook`, the bubble over the
    ideal step the literature gives, (p, v, m) -> fraction, where it gives one (its
    docstring is the formula the docs print).
    """

    name: str
    order: ComputeOrder
    family: LayoutFamily
    check: Optional[Callable[[str, int, int], None]] = None
    torch_class: Optional[str] = None
    needs: str = ""
    peak: str = ""
    textbook: Optional[Callable[[int, int, int], float]] = None


def _one_chunk_bubble(p: int, v: int, m: int) -> float:
    """(p-1)/m"""
    return (p - 1) / m


def _interleaved_bubble(p: int, v: int, m: int) -> float:
    """(p-1)/(v m)"""
    return (p - 1) / (v * m)


SCHEDULES: Dict[str, Schedule] = {s.name: s for s in (
    Schedule("1f1b", one_f_one_b, ONE_STAGE_LAYOUT, torch_class="1F1B",
             needs="n = p (any m; torch needs m >= p)", peak="min(p - r, m)",
             textbook=_one_chunk_bubble),
    Schedule("dualpipev", dualpipev, V_LAYOUT, _microbatch_per_stage, torch_class="DualPipeV",
             needs="n = 2p, m >= 2p", peak="2p + 1"),
    Schedule("gpipe", gpipe, ONE_STAGE_LAYOUT, torch_class="GPipe", needs="n = p", peak="m",
             textbook=_one_chunk_bubble),
    Schedule("interleaved_1f1b", interleaved_1f1b, INTERLEAVED_LAYOUT, _equal_rounds,
             torch_class="Interleaved1F1B",
             needs="n a multiple of p; m split into max(1, m // p) equal rounds",
             peak="min((v-1)k + 2(p-r) - 1, v m)", textbook=_interleaved_bubble),
    Schedule("looped_bfs", looped_bfs, INTERLEAVED_LAYOUT, torch_class="LoopedBFS",
             needs="n a multiple of p", peak="v m"),
    Schedule("zbv", zbv, V_LAYOUT, torch_class="ZBVZeroBubble", needs="n = 2p (any m)",
             peak="2p once m >= 2p-1"),
    Schedule("zero_bubble", zero_bubble, INTERLEAVED_LAYOUT, _equal_rounds,
             torch_class="InterleavedZeroBubble", needs="as `interleaved_1f1b`",
             peak="min((v-1)k + p, v m)"),
)}

# the schedules of each layout family, by name, as built in (registered ones: `family`)
ONE_STAGE = tuple(s.name for s in SCHEDULES.values() if s.family is ONE_STAGE_LAYOUT)
INTERLEAVED = tuple(s.name for s in SCHEDULES.values() if s.family is INTERLEAVED_LAYOUT)
V_SHAPED = tuple(s.name for s in SCHEDULES.values() if s.family is V_LAYOUT)


def register_schedule(schedule: Schedule) -> Schedule:
    """Adds `schedule` to SCHEDULES (See NOTE: Schedule registry); returns it.

    Example:
        register_schedule(Schedule("my_gpipe", my_order, ONE_STAGE_LAYOUT, needs="n = p"))
    """
    if schedule.name in SCHEDULES:
        raise GraphcError(f"a pipeline schedule named {schedule.name!r} is already registered; "
                          "Fix: give the new one another name")
    SCHEDULES[schedule.name] = schedule
    return schedule


def unregister_schedule(name: str) -> None:
    """Removes a schedule `register_schedule` added (tests register toys and take them out)."""
    del SCHEDULES[name]


def stage_count(schedule: str, num_ranks: int, chunks: int = 2) -> int:
    """The stages a chain needs to run `schedule` on `num_ranks` pipeline ranks: what its
    layout family fixes (p, or 2p for a V), else `chunks` per rank."""
    return SCHEDULES[schedule].family.num_stages(num_ranks) or chunks * num_ranks


def accepts(schedule: str, num_ranks: int, num_stages: int, num_microbatches: int) -> bool:
    """Whether check_schedule lets `schedule` order p ranks, n stages, m micro-batches."""
    try:
        check_schedule(schedule, num_ranks, num_stages, num_microbatches)
    except GraphcError:
        return False
    return True


def layout(schedule: str, num_ranks: int, num_stages: int) -> List[List[int]]:
    """The stage ids each pipeline rank holds under `schedule`, in ascending order."""
    return SCHEDULES[schedule].family.layout(num_ranks, num_stages)


def compute_order(schedule: str, rank: int, num_ranks: int, num_stages: int,
                  num_microbatches: int, training: bool = True) -> List[Instruction]:
    """Pipeline rank `rank`'s compute in order: `schedule`'s in training (checked first by
    check_schedule), each chunk's forwards in stage order in inference."""
    if not training:
        return forward_only(rank, num_ranks, num_stages, num_microbatches, schedule)
    check_schedule(schedule, num_ranks, num_stages, num_microbatches)
    return SCHEDULES[schedule].order(rank, num_ranks, num_stages, num_microbatches)


def check_schedule(schedule: str, num_ranks: int, num_stages: int, num_microbatches: int) -> None:
    """Raises GraphcError unless `schedule` can order p ranks, n stages, m micro-batches.

    The conditions are torch.distributed.pipelining's for the same schedule, except that
    1f1b takes m < p (its warm-up is min(p - s, m); torch's Schedule1F1B needs m >= p):
      gpipe, 1f1b:                 n = p
      interleaved_1f1b, looped_bfs, zero_bubble: n a multiple of p (the same v = n/p chunks
                                   on every rank)
      interleaved_1f1b, zero_bubble: m split into max(1, m // p) rounds of equal size (m a
                                   multiple of p, or m < 2p, or e.g. p=4, m=10: rounds of 5)
      zbv, dualpipev:              n = 2p; dualpipev also m >= 2p
    The layout itself (which rank holds which stage) is checked by pipeline_ranks.

    Example:
        check_schedule("dualpipev", 4, 8, 6)   # GraphcError: needs at least 8 micro-batches
    """
    p, n, m = num_ranks, num_stages, num_microbatches
    if schedule not in SCHEDULES:
        raise GraphcError(f"unknown pipeline schedule {schedule!r}; choose one of "
                          f"{sorted(SCHEDULES)} (see docs/schedules.md)")
    where = f"pipeline schedule '{schedule}' with {p} pipeline ranks"
    SCHEDULES[schedule].family.check(where, p, n)
    if SCHEDULES[schedule].check is not None:
        SCHEDULES[schedule].check(where, p, m)


def pipeline_ranks(stages, schedule: str, training: bool = True) -> List[int]:
    """Each stage's pipeline rank (position 0..p-1), from the placements the user gave.

    Stages on the same ranks form one pipeline rank (it holds several chunks); stages
    whose rank sets overlap without being equal cannot be scheduled. The chunks of each
    pipeline rank must be the ones `layout(schedule, ...)` gives it; otherwise the error
    names the layout the schedule needs.
    """
    groups: List[tuple] = []
    position: List[int] = []
    for s in stages:
        ranks = tuple(s.ranks)
        for g, other in enumerate(groups):
            if other == ranks:
                break
            if set(other) & set(ranks):
                raise GraphcError(
                    f"stage {s.stage_id} runs on ranks {list(ranks)}, which overlap the ranks "
                    f"{list(other)} of an earlier stage without being the same. A rank holds "
                    "several stages (model chunks) only when they have the same placement. Fix: "
                    "give both stages the same placement, or disjoint ones.")
        else:
            groups.append(ranks)
            g = len(groups) - 1
        position.append(g)
    p, n = len(groups), len(stages)
    if not training or schedule not in SCHEDULES:
        return position
    family = SCHEDULES[schedule].family
    have = [[sid for sid, g in enumerate(position) if g == r] for r in range(p)]
    if have != family.layout(p, n) or family.num_stages(p) not in (None, n):
        found = ", ".join(f"ranks {list(groups[r])}: stages {have[r]}" for r in range(p))
        raise GraphcError(f"pipeline schedule {family.needs(schedule, p, n)}; found {found}.")
    return position
