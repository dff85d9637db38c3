"""Measured and simulated traces, read back: timeline_from_trace() turns a Chrome-trace file
into a Timeline for draw_timeline, to put the measured step beside the simulated one.

The runtime writes the measured file (graphc/runtime/trace.py: Tracer, set by
`graph.config.set_trace("trace.json")` or GRAPHC_TRACE); `graphc plan --simulate` writes
simulated_trace.json in the same format (runtime/trace.py: timeline_to_chrome).
"""
from __future__ import annotations

import json
from typing import Optional

from ..errors import GraphcError
from ..runtime.trace import Span, Timeline


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
