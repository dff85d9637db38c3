"""collect_stages: the stages set_stage names, checked for the common mistakes.

Invariant: the StageInfo list numbers the stages 0, 1, ..., p-1 without gaps; every
stage's placement names ranks inside the world, every module of one stage has the same
placement, and no two stages share a rank (pipeline_ranks checks it, for inference:
check_layout adds the schedule's training layout once the graph is known to train).
Without set_stage it is one stage on every rank, on the device of the parameters.
Requires: nothing traced; the spec's per-module settings (compiler.CompileSpec.modules).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import GraphcError
from ..plan.plan import StageInfo
from ..plan.schedules import pipeline_ranks


def collect_stages(spec, world_size: int) -> Tuple[List[StageInfo], Dict[str, int]]:
    """(the stages, each configured module's stage id) of a compiler.CompileSpec."""
    configured = {name: c for name, c in spec.modules.items() if c.stage_id is not None}
    if not configured:
        ranks = tuple(range(world_size))
        return [StageInfo(0, ranks, _default_device_type(spec.root))], {}
    by_id: Dict[int, Any] = {}
    for name, c in sorted(configured.items(), key=lambda kv: kv[1].stage_id):
        check_ranks(f"module '{name}'", c.placement, world_size)
        prev = by_id.setdefault(c.stage_id, (name, c.placement))
        if prev[1] != c.placement:
            raise GraphcError(
                f"stage {c.stage_id} is given two placements: module '{prev[0]}' has {prev[1]} and "
                f"module '{name}' has {c.placement}. Fix: give every module of one stage the same "
                "placement, or different stage ids.")
    ids = sorted(by_id)
    if ids != list(range(len(ids))):
        missing = sorted(set(range(max(ids) + 1)) - set(ids))
        raise GraphcError(f"stage ids must be 0, 1, ..., p-1 without gaps; found {ids} "
                          f"(missing {missing}). Fix: renumber the set_stage calls.")
    stages = [StageInfo(sid, by_id[sid][1].flat_ranks, by_id[sid][1].type) for sid in ids]
    pipeline_ranks(stages, spec.pipeline_schedule, training=False)  # overlaps
    return stages, {name: c.stage_id for name, c in configured.items()}


def check_ranks(who: str, placement, world_size: int) -> None:
    """Refuses a placement naming a rank outside the world; `who` placed it (for the message).
    Stages from placements are checked by it too (collect_placed_stages)."""
    bad = [r for r in placement.flat_ranks if r >= world_size]
    if bad:
        raise GraphcError(
            f"{who}: placement {placement} names rank(s) {bad}, but the world has "
            f"{world_size} rank(s) (0..{world_size - 1}). Fix: launch with torchrun "
            f"--nproc_per_node {max(placement.flat_ranks) + 1}, or use ranks below {world_size}.")


def traced_autocast(stages: List[StageInfo], amp_dtype: Optional[torch.dtype]) -> Optional[tuple]:
    """config.enable_amp: the (device type, dtype) build() is traced under with torch.autocast
    (NOTE: Autocast regions), the device type of the stages' placements; None without AMP."""
    if amp_dtype is None:
        return None
    return ("cuda" if any(s.device_type == "cuda" for s in stages) else "cpu", amp_dtype)


def _default_device_type(root: torch.nn.Module) -> str:
    for p in root.parameters():
        return "cuda" if p.is_cuda else "cpu"
    return "cpu"
