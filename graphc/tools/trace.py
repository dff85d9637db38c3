"""Runtime traces: every rank's measured instruction timeline, merged into one Chrome-trace file.

Turn it on with `graph.config.set_trace("trace.json")` or GRAPHC_TRACE=trace.json
(GRAPHC_TRACE=1 only records events into graph.last_stats.events). For the first
`steps` steps (default 5) each rank sends its events to rank 0 (gather_object over the
default group, after the step), which rewrites the merged file. Open it in
https://ui.perfetto.dev or chrome://tracing: one process per rank, one slice per
instruction. `timeline_from_trace()` reads it back for draw_timeline, to put the
measured step beside the simulated one (`graphc plan --simulate` writes
simulated_trace.json in the same format).
"""
from __future__ import annotations

import json
import os
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import GraphcError
from ..plan.instructions import parse_instruction
from .rows import fold_ranks, row_label
from .simulate import Span, Timeline, kind_of

DEFAULT_STEPS = 5


def trace_setting(config_path: Optional[str]) -> Tuple[bool, Optional[str]]:
    """(record events?, merged file path or None) from the config option, else GRAPHC_TRACE."""
    value = config_path or os.environ.get("GRAPHC_TRACE", "")
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
        spans.append(Span(rank, i, text.split(" ")[0], kind_of(ins), getattr(ins, "microbatch", None),
                          t0 - origin, t1 - origin))
    return spans


def timeline_to_chrome(timeline: Timeline, process_prefix: str = "rank", step: int = 0,
                       events: Optional[List[dict]] = None, fold: bool = False,
                       notes: Optional[Dict[int, str]] = None) -> dict:
    """A Chrome-trace dict: one process per rank, one complete ("X") slice per span (us).

    fold: ranks with identical timelines share one process (pid: the first of them, named
    like a chart row, `simulated ranks 0-7, stage 0`, with the ranks in its args), so the
    trace of a thousand-rank simulation stays small enough to open.
    """
    out = events if events is not None else []
    groups = fold_ranks(timeline) if fold else [[r] for r in sorted(timeline)]
    for ranks in groups:
        rank = ranks[0]
        if step == 0:   # process names once, with the first step
            name = (f"{process_prefix} {rank}" if not fold else
                    f"{process_prefix} {row_label(ranks, notes)}")
            out.append({"name": "process_name", "ph": "M", "pid": rank,
                        "args": {"name": name, **({"ranks": ranks} if fold else {})}})
            out.append({"name": "process_sort_index", "ph": "M", "pid": rank,
                        "args": {"sort_index": rank}})
        for s in timeline[rank]:
            out.append({"name": s.label, "cat": s.kind, "ph": "X", "pid": rank, "tid": 0,
                        "ts": s.start * 1e6, "dur": max(s.end - s.start, 0.0) * 1e6,
                        "args": {"step": step + s.step,
                                 "microbatch": s.microbatch, "index": s.index}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def timeline_from_trace(path: str, step: Optional[int] = None) -> Timeline:
    """Reads a merged (or simulated) trace back as a Timeline; `step` picks one step.

    Times are made relative to the chosen step's first event, so it charts from zero.
    """
    try:
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    except (OSError, ValueError, KeyError) as e:
        raise GraphcError(f"cannot read Chrome trace {path!r}: {e}. Fix: pass the file written by "
                          "GRAPHC_TRACE=path or graphc plan --simulate") from e
    slices = [e for e in events if e.get("ph") == "X"]
    if step is None:
        step = max((e["args"].get("step", 0) for e in slices), default=0)
    slices = [e for e in slices if e["args"].get("step", 0) == step]
    origin = min((e["ts"] for e in slices), default=0.0)
    timeline: Timeline = {}
    for e in slices:
        timeline.setdefault(e["pid"], []).append(
            Span(e["pid"], e["args"].get("index", 0), e["name"], e["cat"], e["args"].get("microbatch"),
                 (e["ts"] - origin) * 1e-6, (e["ts"] + e["dur"] - origin) * 1e-6))
    return timeline


class Tracer:
    """One rank's side of the merged trace (see module docstring)."""

    def __init__(self, rank: int, path: Optional[str], record: bool, steps: int = DEFAULT_STEPS):
        self.rank, self.path, self.record, self.steps = rank, path, record, steps
        self.recorded = 0
        self.events: List[dict] = []
        # perf_counter has no common origin across processes; the wall clock does
        self.wall_offset = time.time() - time.perf_counter()

    @staticmethod
    def from_config(config, rank: int) -> "Tracer":
        record, path = trace_setting(getattr(config, "trace_path", None))
        return Tracer(rank, path, record, getattr(config, "trace_steps", DEFAULT_STEPS))

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
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    out = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, out, dst=0)
    return out
