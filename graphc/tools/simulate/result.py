"""What a simulation returns: the timeline, the step time and a summary per rank."""
from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

from ...plan.plan import ExecutionPlan
from ...runtime.trace import Span, Timeline
from .model_state import ModelState
from .peak import MemoryPeak


EVERY_RANK_BELOW = 64   # a simulated world this small gets a table row per rank, classes or not


@dataclass
class RankSummary:
    rank: int
    stages: List[int]
    busy: float                # time spent in compute
    finish: float              # when the rank's last instruction ends
    bubble: float              # 1 - busy / step_time (ranks that compute)
    peak_live_microbatches: int
    peak_activation_bytes: int
    model_state: Optional[ModelState] = None   # with simulate(..., model=...)
    memory: Optional["MemoryPeak"] = None      # with simulate(..., model=...): the step's peak


@dataclass
class SimResult:
    timeline: Timeline
    step_time: float           # one step's makespan, or the steady-state period (steps > 1)
    ranks: List[RankSummary] = field(default_factory=list)
    step_ends: List[float] = field(default_factory=list)   # when the last rank ended each step
    steps: int = 1
    model_note: str = ""       # where the optimizer's state count came from (with model state)
    # template rank -> the ranks it stands for, where the world was simulated by its templates
    # (NOTE: Simulated classes): the table shows one row per class
    classes: Optional[Dict[int, List[int]]] = None

    @property
    def first_step_time(self) -> float:
        return self.step_ends[0] if self.step_ends else self.step_time

    @property
    def bubble_fraction(self) -> float:
        """The mean bubble over the ranks that run a stage."""
        working = [r.bubble for r in self.ranks if r.stages]
        return sum(working) / len(working) if working else 0.0

    def table(self, unit: str = "ms", scale: float = 1e3, every_rank: Optional[bool] = None) -> str:
        """A per-rank table: compute, finish, bubble, peak live micro-batches and memory (and
        model state: parameters, gradients, optimizer state, where simulated).

        every_rank: a row per rank, or (False) one per class where the world was simulated
        by classes; None: per rank below EVERY_RANK_BELOW ranks."""
        model = any(r.model_state is not None for r in self.ranks)
        folded = self.classes is not None and not (
            every_rank if every_rank is not None else len(self.ranks) < EVERY_RANK_BELOW)
        head = (f"{'rank':>4}  {'stages':>6}  {'compute ' + unit:>12}  {'finish ' + unit:>12}  "
                f"{'bubble':>7}  {'live mb':>7}  {'peak act MiB':>12}")
        if model:
            head += (f"  {'params MiB':>10}  {'grads MiB':>10}  {'optim MiB':>10}  {'model MiB':>10}"
                     f"  {'peak MiB':>10}  peak at")
        if folded:
            head += "  stands for"
        rows = [head]
        for r in self._shown_ranks(folded):
            row = (f"{r.rank:>4}  {','.join(map(str, r.stages)) or '-':>6}  "
                   f"{r.busy * scale:>12.3f}  {r.finish * scale:>12.3f}  {r.bubble:>7.1%}  "
                   f"{r.peak_live_microbatches:>7}  {r.peak_activation_bytes / 2**20:>12.3f}")
            m = r.model_state
            if m is not None:
                row += "".join(f"  {b / 2**20:>10.3f}" for b in (m.params, m.grads, m.optimizer, m.total))
            if r.memory is not None:
                row += f"  {r.memory.peak / 2**20:>10.3f}  {r.memory.at}"
            if folded:
                row += f"  {_progression(self.classes[r.rank])}"
            rows.append(row)
        what = (f"steady-state step time (period over {self.steps} steps; first step "
                f"{self.first_step_time * scale:.3f} {unit})" if self.steps > 1 else "step time")
        rows.append(f"{what} {self.step_time * scale:.3f} {unit}, mean bubble "
                    f"{self.bubble_fraction:.1%}")
        if model:
            rows.append("model state per rank: parameters held between steps, gradient buffers "
                        f"at the optimizer step, optimizer state ({self.model_note}); peak: the "
                        "step's predicted highest bytes and the instruction holding it "
                        "(NOTE: Peak memory model)")
        if folded:
            rows.append(f"simulated as classes: {len(self.ranks)} ranks in {len(self.classes)}, each row a "
                        "template rank and every rank its plan stands for (NOTE: Simulated classes)")
        return "\n".join(rows)

    def _shown_ranks(self, folded: bool) -> List[RankSummary]:
        """Every rank's row, or one per class (its template's)."""
        return [r for r in self.ranks if r.rank in self.classes] if folded else self.ranks


def _progression(ranks: List[int]) -> str:
    """[1, 5, 9, 13] -> '1, 5, ..., 13 (4 ranks)'; a short list as it is."""
    if len(ranks) <= 3:
        return ", ".join(map(str, ranks))
    steps = {b - a for a, b in zip(ranks, ranks[1:])}
    if len(steps) == 1:
        return f"{ranks[0]}, {ranks[1]}, ..., {ranks[-1]} ({len(ranks)} ranks)"
    return f"{ranks[0]}, {ranks[1]}, ... ({len(ranks)} ranks)"


class SimTimeline(Mapping):
    """rank -> its Spans in issue order, built on demand from the simulated times."""

    def __init__(self, plans: Dict[int, ExecutionPlan], shown: Dict[int, tuple],
                 starts: Dict[int, array], ends: Dict[int, array]):
        self._plans, self._shown, self._starts, self._ends = plans, shown, starts, ends

    def __getitem__(self, rank: int) -> List[Span]:
        return self.spans(rank)

    def spans(self, rank: int, shown_as: Optional[int] = None) -> List[Span]:
        """rank's Spans, each under the rank `shown_as` (default its own): a rank of a class
        shows its template's (NOTE: Simulated classes)."""
        labels, kinds, mbs = self._shown[rank]
        n, shown_as = len(labels), rank if shown_as is None else shown_as
        return [Span(shown_as, k % n, labels[k % n], kinds[k % n], mbs[k % n], t0, t1, k // n)
                for k, (t0, t1) in enumerate(zip(self._starts[rank], self._ends[rank]))]

    def __iter__(self) -> Iterator[int]:
        return iter(self._plans)

    def __len__(self) -> int:
        return len(self._plans)

    def signature(self, rank: int) -> tuple:
        """Equal for two ranks exactly when their timelines show the same boxes at the same
        times (ranks of one stage usually do): charts fold them into one row."""
        return self._shown[rank][0], self._starts[rank].tobytes(), self._ends[rank].tobytes()
