"""Runtime traces: every rank's measured instruction timeline, merged into one Chrome-trace file.

Turn it on with `graph.config.set_trace("trace.json")` or GRAPHC_TRACE=trace.json
(GRAPHC_TRACE=1 only records events into graph.last_stats.events). For the first
`steps` steps (default 5) each rank sends its events to rank 0 (gather_object over the
default group, after the step), which rewrites the merged file. Open it in
https://ui.perfetto.dev or chrome://tracing: one process per rank, one slice per
instruction.

A timeline here is what the simulator predicts too (graphc/tools/simulate/): Spans of
instructions by kind, written in the same Chrome format (`graphc plan --simulate` writes
simulated_trace.json), and read back by graphc/tools/trace.timeline_from_trace.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import List, NamedTuple, Optional, Sequence, Tuple

from .. import env, world
from ..plan.instructions import COMPUTE, INSTRUCTIONS, parse_instruction

DEFAULT_STEPS = 5


class Span(NamedTuple):
    """One instruction on one rank's timeline (seconds, or cost units for unit costs)."""

    rank: int
    index: int
    label: str
    kind: str                  # see KINDS
    microbatch: Optional[int]
    start: float
    end: float
    step: int = 0              # which step (simulate(..., steps=n) runs several)


Timeline = Mapping  # rank -> List[Span]: a dict, or simulate()'s SimTimeline

# what instructions show as on a timeline (each class's span_kind); compute counts as busy time
COMPUTE_KINDS = tuple(cls.span_kind for cls in COMPUTE)
KINDS = tuple(dict.fromkeys(cls.span_kind for cls in INSTRUCTIONS))


def trace_setting(config_path: Optional[str]) -> Tuple[bool, Optional[str]]:
    """(record events?, merged file path or None) from the config option, else GRAPHC_TRACE."""
    value = config_path or env.read("GRAPHC_TRACE")
    if value in ("", "0"):
        return False, None
    if value == "1":
        return True, None
    return True, value


def spans_from_events(rank: int, events: Sequence[Tuple[str, float, float]],
                      origin: float = 0.0) -> List[Span]:
    """StepStats.events (instruction text, start, end) as Spans, times relative to origin."""
    spans = []
    for i, (text, t0, t1) in enumerate(events):
        ins = parse_instruction(text)
        spans.append(Span(rank, i, text.split(" ")[0], ins.span_kind, getattr(ins, "microbatch", None),
                          t0 - origin, t1 - origin))
    return spans


def timeline_to_chrome(timeline: Timeline, process_prefix: str = "rank", step: int = 0,
                       events: Optional[List[dict]] = None,
                       rows: Optional[List[Tuple[List[int], str]]] = None) -> dict:
    """A Chrome-trace dict: one process per rank, one complete ("X") slice per span (us).

    rows: (ranks, label) pairs that fold ranks with identical timelines into one process
    (pid: the first of them, named `<process_prefix> <label>`, with the ranks in its args;
    graphc/tools/rows.py finds and labels them), so the trace of a thousand-rank simulation
    stays small enough to open.
    """
    out = events if events is not None else []
    for ranks, label in rows if rows is not None else [([r], None) for r in sorted(timeline)]:
        rank = ranks[0]
        if step == 0:   # process names once, with the first step
            name = f"{process_prefix} {rank}" if rows is None else f"{process_prefix} {label}"
            out.append({"name": "process_name", "ph": "M", "pid": rank,
                        "args": {"name": name, **({"ranks": ranks} if rows is not None else {})}})
            out.append({"name": "process_sort_index", "ph": "M", "pid": rank,
                        "args": {"sort_index": rank}})
        for s in timeline[rank]:
            out.append({"name": s.label, "cat": s.kind, "ph": "X", "pid": rank, "tid": 0,
                        "ts": s.start * 1e6, "dur": max(s.end - s.start, 0.0) * 1e6,
                        "args": {"step": step + s.step,
                                 "microbatch": s.microbatch, "index": s.index}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


class Tracer:
    """One rank's side of the merged trace (see module docstring)."""

    def __init__(self, rank: int, path: Optional[str], record: bool, steps: int = DEFAULT_STEPS):
        self.rank, self.path, self.record, self.steps = rank, path, record, steps
        self.recorded = 0
        self.events: List[dict] = []
        # perf_counter has no common origin across processes; the wall clock does
        self.wall_offset = time.time() - time.perf_counter()

    @staticmethod
    def for_options(options, rank: int) -> "Tracer":
        """The tracer a graph's RunOptions (runtime/options.py) ask for, else GRAPHC_TRACE's."""
        record, path = trace_setting(options.trace_path)
        return Tracer(rank, path, record, options.trace_steps)

    def after_step(self, stats) -> None:
        """Collective while tracing to a file: every rank must call it after the same step."""
        if self.path is None or self.recorded >= self.steps:
            return
        mine = [(text, t0 + self.wall_offset, t1 + self.wall_offset) for text, t0, t1 in stats.events]
        gathered = _gather_to_rank0(self.rank, mine)
        if self.rank == 0:
            self._merge(gathered)
        self.recorded += 1

    def _merge(self, per_rank: List[list]) -> None:
        if not self.events:
            self.origin = min((ev[1] for evs in per_rank for ev in evs), default=0.0)
        timeline = {r: spans_from_events(r, evs, self.origin) for r, evs in enumerate(per_rank)}
        timeline_to_chrome(timeline, "rank", self.recorded, self.events)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump({"traceEvents": self.events, "displayTimeUnit": "ms"}, f)


def _gather_to_rank0(rank: int, mine: list) -> List[list]:
    everyone = world.multi()
    if everyone is None:
        return [mine]
    out = everyone.gather_object(mine, dst=0)
    return out
