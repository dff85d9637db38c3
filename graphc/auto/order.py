"""The order round 2 of the search compiles its candidates in (NOTE: Layout search): the best
estimate of each kind (pipeline, tensor and data degree, schedule), best first; then the
checkpointed twins of pipelines that did not fit (NOTE: Memory check of the search in
fit.py); then every other setting, best estimate first (the estimates rank kinds less surely
than the settings within one)."""
from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Dict, Iterator, List, Optional, Tuple


def diverse(cands: List) -> Tuple[List, List]:
    """(the best estimate of each kind, the rest), each in the order of `cands`."""
    firsts, rest, kinds = [], [], set()
    for c in cands:
        kind = (c.layout.pp, c.layout.tp, c.layout.dp, c.layout.schedule)
        (rest if kind in kinds else firsts).append(c)
        kinds.add(kind)
    return firsts, rest


class CompileOrder:
    """The candidates in round 2's order; `after` queues a compiled pipeline's twin."""

    def __init__(self, fitting: List):
        firsts, rest = diverse(fitting)
        self._queues = (deque(firsts), deque(), deque(rest))
        self._twins = {c.layout: c for c in fitting if c.layout.checkpointing == "always"}
        self._siblings: Dict = {}     # a queued twin's layout -> its sibling's CompiledGraph

    def __iter__(self) -> Iterator:
        given = set()
        while any(self._queues):
            c = next(q for q in self._queues if q).popleft()
            if id(c) not in given:    # a twin is queued twice: among the rest too
                given.add(id(c))
                yield c

    def sibling(self, c):
        """The CompiledGraph whose plans score the twin `c` (None: `c` is compiled)."""
        return self._siblings.pop(c.layout, None)

    def after(self, c, compiled, best) -> None:
        """A compiled pipeline too big for the memory model but faster than the best so far:
        its checkpointed twin next while nothing fits, else after every kind's best."""
        twin = self._twin(c, best) if isinstance(getattr(compiled, "plans", None), list) else None
        if twin is not None:
            (self._queues[0].appendleft if best is None else self._queues[1].append)(twin)
            self._siblings[twin.layout] = compiled

    def _twin(self, c, best) -> Optional[object]:
        if c.fits or c.step is None or c.layout.checkpointing != "never" or c.layout.pp == 1:
            return None     # pp1 holds one micro-batch at a time: its recompute holds as much
        if best is not None and c.step >= best.step:    # the twin is slower than c
            return None
        return self._twins.get(replace(c.layout, checkpointing="always"))


def checkpointed(plans: list, layout) -> list:
    """A layout's plans with another checkpointing: the only field of the plans it changes
    (the runtime reads it for which micro-batches to recompute; benchmarks/auto_paper.py checks
    that a twin's own compile gives the same instructions)."""
    return [replace(p, checkpointing=layout.checkpointing) for p in plans]
