"""The rows of a chart or trace: ranks that run identical timelines folded into one row.

Ranks of one stage run the same program, so a thousand-rank plan usually shows a few dozen
distinct timelines; charts (chart.py) and the simulated Chrome trace (dump.py) draw one
row per distinct timeline, labelled with its ranks: `ranks 0-7, stage 0`.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from .simulate import Timeline


def fold_ranks(timeline: Timeline) -> List[List[int]]:
    """Ranks grouped by identical timelines (same boxes, kinds and times), in rank order.

    Uses the timeline's own `signature(rank)` where it has one (simulate()'s SimTimeline),
    so that only the rows drawn are ever built as Spans.
    """
    signature = getattr(timeline, "signature", None) or (
        lambda rank: tuple((s.label, s.kind, s.microbatch, s.start, s.end, s.step)
                           for s in timeline[rank]))
    groups: Dict[object, List[int]] = {}
    for rank in sorted(timeline):
        groups.setdefault(signature(rank), []).append(rank)
    return sorted(groups.values())


def ranges(ranks: Sequence[int]) -> str:
    """[2, 3, 4, 7] -> '2-4, 7'."""
    ranks = list(ranks)
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ", ".join(out)


def row_label(ranks: Sequence[int], notes: Optional[Dict[int, str]] = None) -> str:
    """`rank 3 (stage 1)` for one rank, `ranks 0-7, stage 0` for several.

    notes: rank -> what it runs ("stage 0", "idle"); a folded row shows the notes of its
    ranks once each.
    """
    notes = notes or {}
    said = list(dict.fromkeys(notes[r] for r in ranks if r in notes))
    if len(ranks) == 1:
        return f"rank {ranks[0]}" + (f" ({said[0]})" if said else "")
    return f"ranks {ranges(ranks)}" + (f", {'; '.join(said)}" if said else "")
