"""draw_timeline(): a schedule chart, one row per rank, one box per instruction over time.

Used for the static schedule (unit costs), the simulated step and a measured trace, so
the three read the same way. Forward, backward, communication waits, collectives and the
optimizer step have distinct colours; compute boxes carry their micro-batch number.

matplotlib is the `plan` extra (`pip install "graphc[plan]"`), imported only when a chart
is drawn, so training nodes install graphc without it.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

from ..errors import GraphcError
from .simulate import Span

INSTALL_HINT = 'pip install "graphc[plan]"'

COLOURS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "send": "#8C8C8C",
    "recv": "#C44E52",
    "collective": "#8172B3",
    "optimizer": "#55A868",
}
LEGEND = {
    "forward": "forward (micro-batch number on the box)",
    "backward": "backward",
    "recv": "recv: waiting for data",
    "send": "send: posting the transfer",
    "collective": "collective (all-reduce)",
    "optimizer": "optimizer step",
}


def draw_timeline(timeline: Dict[int, List[Span]], path: str, title: str,
                  time_unit: str = "ms", scale: float = 1e3,
                  row_labels: Optional[Dict[int, str]] = None,
                  formats: Sequence[str] = ("png", "svg")) -> List[str]:
    """Draws the chart; writes `path`.png and `path`.svg (path without extension).

    Args:
        timeline: rank -> spans (simulate().timeline, or trace.timeline_from_trace()).
        title: the chart's title (say what the times are: unit costs, simulated, measured).
        time_unit, scale: axis label unit and the factor from span times to it.
        row_labels: rank -> label of its row (default "rank r").
    Returns:
        The written file paths.
    """
    plt, Patch = _pyplot()
    ranks = sorted(timeline)
    end = max((s.end for spans in timeline.values() for s in spans), default=1.0) * scale or 1.0
    fig, ax = plt.subplots(figsize=(max(8.0, min(24.0, 4 + 0.12 * _count(timeline))),
                                    max(1.8, 1.2 + 0.6 * len(ranks))))
    used = set()
    for row, rank in enumerate(ranks):
        for span in timeline[rank]:
            used.add(span.kind)
            _box(ax, span, len(ranks) - 1 - row, scale, end)
    ax.set_yticks(range(len(ranks)))
    labels = row_labels or {}
    ax.set_yticklabels([labels.get(r, f"rank {r}") for r in reversed(ranks)])
    ax.set_ylim(-0.6, len(ranks) - 0.4)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel(f"time ({time_unit})")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=COLOURS[k], label=LEGEND[k]) for k in COLOURS if k in used]
    # beside the rows, so it never covers the time axis whatever the number of ranks
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), ncol=1,
              fontsize=8, frameon=False)
    fig.tight_layout()
    written = []
    for fmt in formats:
        out = f"{path}.{fmt}"
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        fig.savefig(out, dpi=120, bbox_inches="tight")
        written.append(out)
    plt.close(fig)
    return written


def charts_available() -> bool:
    """Whether matplotlib (the `plan` extra) can be imported, so draw_timeline() will work."""
    try:
        _pyplot()
    except GraphcError:
        return False
    return True


def _pyplot():
    """matplotlib.pyplot (headless) and Patch, or a GraphcError saying what to install."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        raise GraphcError(f"graphc's schedule charts need matplotlib, which is not installed "
                          f"({e}). Fix: {INSTALL_HINT} (the `plan` extra), or pass --no-chart "
                          f"to graphc plan.") from None
    return plt, Patch


def _count(timeline) -> int:
    return max((len(v) for v in timeline.values()), default=0)


def _box(ax, span: Span, y: float, scale: float, end: float) -> None:
    start, width = span.start * scale, (span.end - span.start) * scale
    height = 0.8 if span.kind in ("forward", "backward", "optimizer", "collective") else 0.4
    ax.barh(y, width, left=start, height=height, color=COLOURS.get(span.kind, "#333333"),
            edgecolor="white", linewidth=0.5)
    if span.kind in ("forward", "backward") and span.microbatch is not None and width > end * 0.012:
        ax.text(start + width / 2, y, str(span.microbatch), ha="center", va="center",
                fontsize=8, color="white", fontweight="bold")
