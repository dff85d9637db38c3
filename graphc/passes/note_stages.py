"""note_stages: every rank's plan notes the stages nobody wrote down, found from placements.

Invariant: when the placements give other stages than the one stage on every rank that a
program without them runs on, every plan has notes["stages"] = 'stages found from
placements: stage 0 = ranks [0, 1] (...), ...' (printed as `# stages: ...`); otherwise the
plans are unchanged.
Requires: place_by_layout (gm.meta[META_FOUND_STAGES]), the plans (lower_plan onwards).
"""
from __future__ import annotations

from typing import List

import torch.fx as fx

from ..plan.plan import ExecutionPlan
from .place_by_layout import found_stages


def note_stages(plans: List[ExecutionPlan], gm: fx.GraphModule, world_size: int) -> List[ExecutionPlan]:
    note = stages_note(gm, world_size)
    if note:
        for plan in plans:
            plan.notes["stages"] = note
    return plans


def stages_note(gm: fx.GraphModule, world_size: int) -> str:
    """'stages found from placements: stage 0 = ranks [0, 1] (...), ...', or '' when the
    placements give the one stage on every rank that a program without them runs on."""
    found = found_stages(gm)
    if not found or (len(found) == 1 and sorted(found[0].placement.flat_ranks) == list(range(world_size))):
        return ""
    return "stages found from placements: " + ", ".join(f"stage {i} = {f}" for i, f in enumerate(found))
