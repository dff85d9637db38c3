"""check_layout: a training graph's stages sit on ranks the pipeline schedule can run.

Invariant (checked, nothing changes): pipeline_ranks accepts the stages for training
under the schedule (its layout family: one stage per rank, interleaved or V); a refusal
names a module of each stage.
Requires: the final stages (collect_stages, or collect_placed_stages without set_stage);
compile() runs it for training graphs only.
"""
from __future__ import annotations

from typing import Dict, List

from ..errors import GraphcError
from ..plan.plan import StageInfo
from ..plan.schedules import pipeline_ranks


def check_layout(stages: List[StageInfo], stage_of_module: Dict[str, int], schedule: str) -> None:
    try:
        pipeline_ranks(stages, schedule, training=True)
    except GraphcError as exc:
        first: Dict[int, str] = {}
        for name, sid in sorted(stage_of_module.items()):
            first.setdefault(sid, name)
        where = ", ".join(f"stage {sid}: module '{name}'" for sid, name in sorted(first.items()))
        raise GraphcError(f"{exc}{' (' + where + ')' if where else ''}") from None
