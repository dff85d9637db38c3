"""Layout families of pipeline schedules: how a family lays n stages on p pipeline ranks.

One stage per rank (gpipe, 1f1b), stage s on rank s mod p (the interleaved ones) or stages s
and 2p-1-s on rank s (the V ones), each with its check of a stage count and the words an
error uses for the layout it needs. A `Schedule` record (plan/schedules.py) names its family.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

from ..errors import GraphcError


@dataclass(frozen=True)
class LayoutFamily:
    """How a family of schedules lays n stages on p pipeline ranks, and what that needs."""

    name: str
    layout: Callable[[int, int], List[List[int]]]   # (p, n) -> each rank's stage ids, ascending
    num_stages: Callable[[int], Optional[int]]      # p -> the stages it needs; None: a multiple of p
    check: Callable[[str, int, int], None]          # (where, p, n): refuses a stage count
    needs: Callable[[str, int, int], str]           # (schedule, p, n): the layout, for an error
    holds: str                                      # what rank r holds, for docs/schedules.md


def _one_stage_check(where: str, p: int, n: int) -> None:
    if n != p:
        raise GraphcError(f"{where} runs one stage per rank; found {n} stages. Fix: give each "
                          "stage its own ranks, or choose 'interleaved_1f1b' for several stages "
                          "per rank")


def _one_stage_needs(schedule: str, p: int, n: int) -> str:
    return (f"'{schedule}' runs one stage per rank, so every stage needs its own placement. "
            "Fix: give each stage disjoint ranks, or choose a schedule for several chunks per "
            "rank: config.set_pipeline_schedule('interleaved_1f1b') (stage s on the ranks of "
            "stage s mod p) or 'zbv' / 'dualpipev' (stages s and 2p-1-s on one rank)")


def _interleaved_check(where: str, p: int, n: int) -> None:
    if n % p:
        fits = " or ".join(str(k) for k in sorted({max(p, n // p * p), (n // p + 1) * p}))
        raise GraphcError(f"{where} needs the same number of stages on every rank (a multiple "
                          f"of {p}); found {n} stages. Fix: split the model into {fits} stages")


def _interleaved_needs(schedule: str, p: int, n: int) -> str:
    return (f"'{schedule}' needs stage s on the ranks of stage s mod p, the same number of "
            f"chunks on every rank (for p={p}: " +
            ", ".join(f"{list(range(r, n, p))}" for r in range(p)) + ")")


def _v_check(where: str, p: int, n: int) -> None:
    if n != 2 * p:
        ranks = f", or use {n // 2} pipeline ranks" if n % 2 == 0 and n else ""
        raise GraphcError(f"{where} needs exactly two stages per rank, {2 * p} in all; found "
                          f"{n}. Fix: split the model into {2 * p} stages{ranks}")


def _v_needs(schedule: str, p: int, n: int) -> str:
    return (f"'{schedule}' needs 2p stages in a V: stages s and 2p-1-s on pipeline rank s "
            f"(for p={p}: " + ", ".join(f"{r} and {2 * p - 1 - r}" for r in range(p)) + ")")


def _round_robin(p: int, n: int) -> List[List[int]]:
    return [list(range(r, n, p)) for r in range(p)]


# one stage per rank (gpipe, 1f1b); stage s on rank s mod p (interleaved); s and 2p-1-s (V)
ONE_STAGE_LAYOUT = LayoutFamily("one stage per rank", _round_robin, lambda p: p,
                                _one_stage_check, _one_stage_needs, "stage r")
INTERLEAVED_LAYOUT = LayoutFamily("interleaved", _round_robin, lambda p: None,
                                  _interleaved_check, _interleaved_needs, "stages r, r+p, ...")
V_LAYOUT = LayoutFamily("V", lambda p, n: [sorted((r, 2 * p - 1 - r)) for r in range(p)],
                        lambda p: 2 * p, _v_check, _v_needs, "stages r, 2p-1-r")
