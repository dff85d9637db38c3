"""Compute orders of pipeline schedules: per pipeline rank, its chunks' compute in order.

A schedule is a pure function `(rank, num_ranks, num_stages, num_microbatches)` -> the
instructions pipeline rank `rank` (0..p-1) computes, in order, naming global stage ids
(Forward `sFm`, Backward `sBm`, split backward `sIm` / `sWm`, DualPipeV's OverlapFB).
`layout(schedule, p, num_stages)` says which stages each pipeline rank holds: one stage per
rank for gpipe and 1f1b, stage s on rank s mod p for the interleaved ones (interleaved_1f1b,
looped_bfs, zero_bubble), stages s and 2p-1-s on rank s for the V ones (zbv, dualpipev).
Communication is added later by lowering (`passes/lower_plan.py`).
"""
from __future__ import annotations

from typing import Callable, Dict, List

from ..errors import GraphcError
from .instructions import Backward, Forward, Instruction

Schedule = Callable[[int, int, int, int], List[Instruction]]


def gpipe(rank: int, num_ranks: int, num_stages: int, num_microbatches: int) -> List[Instruction]:
    """All forwards, then all backwards: every stage holds m micro-batches of activations."""
    m = num_microbatches
    return [Forward(rank, i) for i in range(m)] + [Backward(rank, i) for i in range(m)]


def one_f_one_b(rank: int, num_ranks: int, num_stages: int, num_microbatches: int) -> List[Instruction]:
    """1F1B: min(p - s, m) warm-up forwards, then one backward / one forward, then drain.

    Stage s therefore never holds more than min(p - s, m) micro-batches of activations.
    """
    m, stage = num_microbatches, rank
    warmup = min(num_stages - stage, m)
    order: List[Instruction] = [Forward(stage, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Backward(stage, i), Forward(stage, warmup + i)]
    order += [Backward(stage, i) for i in range(m - warmup, m)]
    return order


def forward_only(rank: int, num_ranks: int, num_stages: int, num_microbatches: int) -> List[Instruction]:
    """Inference: each chunk's forwards in micro-batch order, chunks in stage order."""
    return [Forward(s, i) for s in layout("gpipe" if num_stages == num_ranks else "interleaved_1f1b",
                                         num_ranks, num_stages)[rank]
            for i in range(num_microbatches)]


SCHEDULES: Dict[str, Schedule] = {
    "1f1b": one_f_one_b,
    "gpipe": gpipe,
}

ONE_STAGE = ("gpipe", "1f1b")
INTERLEAVED = ("interleaved_1f1b", "looped_bfs", "zero_bubble")
V_SHAPED = ("zbv", "dualpipev")


def layout(schedule: str, num_ranks: int, num_stages: int) -> List[List[int]]:
    """The stage ids each pipeline rank holds under `schedule`, in ascending order."""
    p = num_ranks
    if schedule in V_SHAPED:
        return [sorted((r, 2 * p - 1 - r)) for r in range(p)]
    return [list(range(r, num_stages, p)) for r in range(p)]


def compute_order(schedule: str, rank: int, num_ranks: int, num_stages: int,
                  num_microbatches: int, training: bool = True) -> List[Instruction]:
    if not training:
        return forward_only(rank, num_ranks, num_stages, num_microbatches)
    if schedule not in SCHEDULES:
        raise GraphcError(f"unknown pipeline schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[schedule](rank, num_ranks, num_stages, num_microbatches)


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
    if not training:
        return position
    want = layout(schedule, p, n) if schedule in SCHEDULES else None
    have = [[sid for sid, g in enumerate(position) if g == r] for r in range(p)]
    if want is not None and (have != want or (schedule in ONE_STAGE and n != p)
                             or (schedule in V_SHAPED and n != 2 * p)):
        raise GraphcError(_layout_error(schedule, p, n, groups, have))
    return position


def _layout_error(schedule: str, p: int, n: int, groups, have) -> str:
    found = ", ".join(f"ranks {list(groups[r])}: stages {have[r]}" for r in range(p))
    if schedule in ONE_STAGE:
        need = (f"'{schedule}' runs one stage per rank, so every stage needs its own placement. "
                "Fix: give each stage disjoint ranks, or choose a schedule for several chunks per "
                "rank: config.set_pipeline_schedule('interleaved_1f1b') (stage s on the ranks of "
                "stage s mod p) or 'zbv' / 'dualpipev' (stages s and 2p-1-s on one rank)")
    elif schedule in V_SHAPED:
        need = (f"'{schedule}' needs 2p stages in a V: stages s and 2p-1-s on pipeline rank s "
                f"(for p={p}: " + ", ".join(f"{r} and {2 * p - 1 - r}" for r in range(p)) + ")")
    else:
        need = (f"'{schedule}' needs stage s on the ranks of stage s mod p, the same number of "
                f"chunks on every rank (for p={p}: " +
                ", ".join(f"{list(range(r, n, p))}" for r in range(p)) + ")")
    return f"pipeline schedule {need}; found {found}."
