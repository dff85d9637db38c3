"""Will a candidate fit: the search's estimate, corrected by the memory model as it compiles.

NOTE: Memory check of the search
The estimate (search.memory_estimate) is a formula over one compile on one rank; the memory
model (NOTE: Peak memory model) walks every rank's plan and is what `graphc plan` reports,
so it is the judge: a layout the search returns fits by it (search.py keeps only compiled
candidates whose every rank's peak fits). Where the estimate is optimistic, compiling a
candidate that then does not fit wastes the search's budget, so each compile also teaches
the search: the memory model's peak over the estimate, highest per kind of layout
(`Kind`: whether it pipelines, the tensor degree and checkpointing, which shape the
estimate's formula; the degrees of pipeline and data, the schedule, micro-batches and ZeRO
change its terms; on Llama-3-8B over 64 h100 the ratio of tp1 pipelines was 1.15-1.26 from
pp2 to pp16, of tp2 ones 1.9, of pp1 tp2 1.5), scales the estimates of that kind's later candidates, and one scaled above the
capacity is skipped without compiling (listed in auto.md). A kind not compiled yet keeps its
estimate. A compiled pipeline that does not fit but simulates faster than the best so far has
its checkpointed twin (the same layout with checkpointing "always", when its estimate fits)
compiled next (pp1 holds one micro-batch at a time, and its recompute as much): checkpointing
is the memory model's first advice (memory_fit.py), it keeps
only each stage's inputs, and its recompute costs one forward per micro-batch (NOTE:
Recompute cost), so the twin is often the fastest layout that fits. When nothing fits, the refusal names the least memory the memory model found
enough for a compiled layout (or the estimate's least, scaled, when none was compiled).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

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
