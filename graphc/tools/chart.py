"""draw_timeline(): a schedule chart, one row per distinct timeline, one box per instruction.

Used for the static schedule (unit costs), the simulated step and a measured trace, so
the three read the same way. Ranks that run identical timelines share one row
(`ranks 0-7, stage 0`, see rows.py). Forward (F), backward (B), its split halves
backward_input (I) and backward_weight (W), DualPipeV's overlapped pair (F|B),
communication waits, collectives and the optimizer step have distinct colours; compute
boxes wide enough for it carry their letter and micro-batch (`F3`, `I3`, `F3|B1`).

Boxes are drawn as one compound path per colour (one artist, one SVG element, built from
one array), not one artist or one path per box, so a chart of a thousand ranks and a
hundred thousand boxes draws in about a second.

matplotlib is the `plan` extra (`pip install "graphc[plan]"`), imported only when a chart
is drawn, so training nodes install graphc without it.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..errors import GraphcError
from ..plan.instructions import parse_instruction
from ..runtime.trace import COMPUTE_KINDS
from .rows import fold_ranks, row_label
from .simulate import Span, Timeline

INSTALL_HINT = 'pip install "graphc[plan]"'

COLOURS = {
    "forward": "#4C72B0",
    "pre_pass": "#A1C9F4",
    "backward": "#DD8452",
    "backward_input": "#E9B949",
    "backward_weight": "#937860",
    "overlap": "#2A9D8F",
    "send": "#8C8C8C",
    "recv": "#C44E52",
    "collective": "#8172B3",
    "optimizer": "#55A868",
    "release": "#B0B0B0",
}
LEGEND = {
    "forward": "F: forward (micro-batch on the box)",
    "pre_pass": "P: pre-pass for whole-batch sums (no gradient)",
    "backward": "B: backward",
    "backward_input": "I: backward, input gradients",
    "backward_weight": "W: backward, weight gradients",
    "overlap": "F|B: forward and backward overlapped",
    "recv": "recv: waiting for data",
    "send": "send: posting the transfer",
    "collective": "collective (all-reduce, boxing)",
    "optimizer": "optimizer step",
    "release": "ZeRO-3: whole parameters freed",
}
TALL = ("forward", "pre_pass", "backward", "backward_input", "backward_weight", "overlap", "optimizer",
        "collective")
MAX_TEXTS = 3000        # box captions drawn at most (each is an artist)
EDGE_BOXES = 20000      # above this many boxes, no white outlines (they would hide the boxes)
FORMATS = ("png", "svg")   # what draw_timeline writes by default
DPI = 100               # a 24-inch chart of a thousand ranks: 2400 pixels wide
TIGHT_PAD_INCHES = 0.1  # savefig's pad around the tight box


def draw_timeline(timeline: Timeline, path: str, title: str,
                  time_unit: str = "ms", scale: float = 1e3,
                  notes: Optional[Dict[int, str]] = None,
                  formats: Sequence[str] = FORMATS) -> List[str]:
    """Draws the chart; writes `path`.png and `path`.svg (path without extension).

    Args:
        timeline: rank -> spans (simulate().timeline, or trace.timeline_from_trace()).
        title: the chart's title (say what the times are: unit costs, simulated, measured).
        time_unit, scale: axis label unit and the factor from span times to it.
        notes: rank -> what it runs ("stage 0"), shown in its row's label.
    Returns:
        The written file paths.

    Example:
        draw_timeline(simulate(plans, costs).timeline, "plans/simulated", "simulated step",
                      notes={0: "stage 0", 1: "stage 1"})
    """
    plt, Patch, PathPatch = _pyplot()
    from matplotlib.path import Path
    rows = fold_ranks(timeline)
    spans = [timeline[ranks[0]] for ranks in rows]    # one drawn row per group of ranks
    end = max((s.end for row in spans for s in row), default=1.0) * scale or 1.0
    boxes = sum(len(row) for row in spans)
    row_inches = min(0.6, 120.0 / max(len(rows), 1))   # at most ~120 inches tall
    fig, ax = plt.subplots(figsize=(max(8.0, min(24.0, 4 + 0.12 * max(map(len, spans), default=0))),
                                    max(1.8, 1.2 + row_inches * len(rows))))
    verts: Dict[str, list] = {}     # kind -> [x0, x1, y - h, y + h] per box
    for y, row in zip(range(len(rows) - 1, -1, -1), spans):
        for s in row:
            h = 0.4 if s.kind in TALL else 0.2
            verts.setdefault(s.kind, []).append((s.start * scale, s.end * scale, y - h, y + h))
    edge = boxes <= EDGE_BOXES
    for kind, vs in verts.items():
        # add_artist, not add_patch: the limits are set below, and add_patch would walk
        # every box's segments to update them (seconds at a thousand ranks)
        ax.add_artist(PathPatch(_boxes_path(np.asarray(vs, dtype=float), Path),
                               facecolor=COLOURS.get(kind, "#333333"),
                               edgecolor="white" if edge else "none",
                               linewidth=0.5 if edge else 0.0))
    _captions(ax, fig, spans, scale, end)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([row_label(ranks, notes) for ranks in reversed(rows)],
                       fontsize=8 if row_inches >= 0.3 else 5)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel(f"time ({time_unit})")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(color=COLOURS[k], label=LEGEND[k]) for k in COLOURS if k in verts]
    # beside the rows, so it never covers the time axis whatever the number of ranks
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), ncol=1,
              fontsize=8, frameon=False)
    fig.tight_layout()
    # the tight box (rows, labels and the legend beside them) worked out once for every
    # format, as savefig(bbox_inches="tight") would for each; a PNG compressed fast (zlib
    # level 1: a third larger, a sixth of the encoding time at 8192 ranks)
    box = fig.get_tightbbox(fig.canvas.get_renderer()).padded(TIGHT_PAD_INCHES)
    written = []
    for fmt in formats:
        out = f"{path}.{fmt}"
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        fast = {"pil_kwargs": {"compress_level": 1}} if fmt == "png" else {}
        fig.savefig(out, dpi=DPI, bbox_inches=box, **fast)
        written.append(out)
    plt.close(fig)
    return written


def _boxes_path(boxes, Path):
    """One compound Path of rectangles from an (N, 4) array of x0, x1, y0, y1."""
    x0, x1, y0, y1 = boxes.T
    corners = np.stack([np.stack(c, axis=1) for c in ((x0, y0), (x0, y1), (x1, y1), (x1, y0), (x0, y0))],
                       axis=1)          # (N, 5, 2): each box closed on its first corner
    codes = np.tile(np.array([Path.MOVETO, Path.LINETO, Path.LINETO, Path.LINETO, Path.CLOSEPOLY],
                             dtype=Path.code_type), len(boxes))
    return Path(corners.reshape(-1, 2), codes)


def box_text(span: Span) -> Optional[str]:
    """A compute box's caption: its letter and micro-batch (`F3`, `W0`, `F3|B1`); else None."""
    if span.kind not in COMPUTE_KINDS:
        return None
    try:
        return parse_instruction(span.label).caption
    except GraphcError:
        return None


def _captions(ax, fig, spans: List[List[Span]], scale: float, end: float) -> None:
    """Letters on the compute boxes wide enough for them (about 7 points a character)."""
    points_per_unit = fig.get_size_inches()[0] * 72 * 0.8 / end
    texts = 0
    for y, row in zip(range(len(spans) - 1, -1, -1), spans):
        for s in row:
            width = (s.end - s.start) * scale
            text = box_text(s) if width * points_per_unit > 14 else None
            if text is None or width * points_per_unit < 6 * len(text):
                continue
            ax.text(s.start * scale + width / 2, y, text, ha="center", va="center", fontsize=7,
                    color="white", fontweight="bold")
            texts += 1
            if texts >= MAX_TEXTS:
                return


def charts_available() -> bool:
    """Whether matplotlib (the `plan` extra) can be imported, so draw_timeline() will work."""
    try:
        _pyplot()
    except GraphcError:
        return False
    return True


def _pyplot():
    """matplotlib.pyplot (headless), Patch and PathPatch, or a GraphcError saying what to
    install."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, PathPatch
    except ImportError as e:
        raise GraphcError(f"graphc's schedule charts need matplotlib, which is not installed "
                          f"({e}). Fix: {INSTALL_HINT} (the `plan` extra), or pass --no-chart "
                          f"to graphc plan.") from None
    return plt, Patch, PathPatch
