"""collect_placed_stages: the stages place_by_layout found, checked as set_stage's are.

Invariant: one StageInfo per placement found (gm.meta[META_FOUND_STAGES]), numbered in the
data-flow order place_by_layout gave them, each naming ranks inside the world, no two
sharing a rank; [] when the program places nothing (the one stage collect_stages made
stays). Recorded in the compile history as `placed_stages`.
Requires: place_by_layout (NOTE: Stages from placements).
"""
from __future__ import annotations

from typing import List

import torch.fx as fx

from ..plan.plan import StageInfo
from ..plan.schedules import pipeline_ranks
from .collect_stages import check_ranks
from .place_by_layout import found_stages


def collect_placed_stages(gm: fx.GraphModule, schedule: str, world_size: int) -> List[StageInfo]:
    found = found_stages(gm)
    for f in found:
        check_ranks(f.sources[0], f.placement, world_size)
    stages = [StageInfo(i, f.placement.flat_ranks, f.placement.type) for i, f in enumerate(found)]
    if stages:
        pipeline_ranks(stages, schedule, training=False)  # overlaps
    return stages
