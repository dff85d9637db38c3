"""Will a candidate fit: the search's estimate, corrected by the memory model as it compiles.

NOTE: Memory check of the search
The estimate (search.memory_estimate) is a formula over one compile on one rank; the memory
model (NOTE: Peak memory model) walks every rank's plan and is what `graphc plan` reports,
so it is the judge: the search returns only a compiled layout whose every rank fits by it.
Where the estimate is optimistic, a compiled candidate that does not fit wastes the
search's budget, so each compile also teaches the search:
  * the memory model's peak over the estimate, highest per `Kind` (whether it pipelines, the
    tensor degree, checkpointing: what shapes the estimate's formula; the degrees, schedule,
    micro-batches and ZeRO only change its terms) scales the estimates of that kind's later
    candidates, and one scaled above the capacity is skipped without compiling (listed in
    auto.md); a kind not compiled yet keeps its estimate. On Llama-3-8B over 64 h100 the
    ratios were 1.15-1.26 for tp1 pipelines (pp2 to pp16), 1.5 for pp1 tp2, 1.9 for tp2
    pipelines (before TP_UNSPLIT);
  * a compiled pipeline that does not fit but simulates faster than the best so far has its
    checkpointed twin (the same layout with checkpointing "always", where its estimate fits)
    compiled next while nothing fits, else after the best estimate of every kind:
    checkpointing is the memory model's first advice (memory_fit.py), keeps only each
    stage's inputs and costs one forward per micro-batch (NOTE: Recompute cost). Not for
    pp1, which holds one micro-batch at a time, and its recompute as much. The twin is scored
    on its sibling's plans with the other `checkpointing` (the only field checkpointing
    changes in them: no compile), and compiled only if it wins.
`top` and the budget end the search only once a layout fits. When nothing fits, the refusal
names the least memory the memory model found for a compiled layout.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from ..errors import GraphcError

Kind = Tuple[bool, int, str]       # (pipelined, tensor degree, checkpointing)


def kind_of(layout) -> Kind:
    return layout.pp > 1, layout.tp, layout.checkpointing


class MemoryCheck:
    """The memory model's peak over the estimate, highest per Kind among those compiled."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.ratio: Dict[Kind, float] = {}

    def learn(self, candidate) -> None:
        """After a compile: its memory model's peak against its estimate."""
        if candidate.peak is None or candidate.est_memory <= 0:
            return
        kind = kind_of(candidate.layout)
        self.ratio[kind] = max(self.ratio.get(kind, 0.0), candidate.peak / candidate.est_memory)

    def predicted(self, candidate) -> int:
        """The estimate scaled by its kind's ratio (1 before one of its kind was compiled:
        the ratio corrects, it never makes an estimate smaller)."""
        return int(candidate.est_memory * max(1.0, self.ratio.get(kind_of(candidate.layout), 1.0)))

    def skips(self, candidate) -> bool:
        """Whether the candidate is predicted not to fit; notes why on it."""
        predicted = self.predicted(candidate)
        if predicted <= self.capacity:
            return False
        piped, tp, ckpt = kind = kind_of(candidate.layout)
        candidate.note = (f"skipped: about {predicted / 2**20:.1f} MiB (its estimate x {self.ratio[kind]:.2f}, "
                          f"the memory model's ratio for {'pipelines' if piped else 'pp1'} tp{tp} ckpt {ckpt})")
        return True


def refuse_none_fit(name: str, tried: List, skipped: List, check: MemoryCheck) -> None:
    """Nothing compiled fits by the memory model: the error names the least memory it found."""
    least, layout = least_memory(tried, skipped, check)
    raise GraphcError(f"{name}: none of the {len(tried)} layouts compiled fits {check.capacity / 2**30:.2f} "
                      f"GiB per rank by the memory model ("
                      + "; ".join(f"{c.layout.describe()}: {c.note}" for c in tried[:4])
                      + f"); the least it found is {least / 2**30:.3g} GiB ({layout}). Fix: more ranks, "
                      f"--memory {least / 2**30 * 1.05:.3g}, or a smaller batch")


def least_memory(tried: List, unfit: List, check: MemoryCheck) -> Tuple[int, Optional[str]]:
    """(bytes, layout) of the least memory a layout needs: the memory model's peak of a
    compiled candidate, else the least estimate as the checks scale it."""
    peaks = [c for c in tried if c.peak is not None]
    if peaks:
        c = min(peaks, key=lambda c: c.peak)
        return c.peak, c.layout.describe()
    if unfit:
        c = min(unfit, key=check.predicted)
        return check.predicted(c), c.layout.describe()
    return 0, None
