"""warn_replicated_stages: a stage whose ranks would all compute the same thing is named.

Invariant: none; a check. A stage placed on several ranks where every value is broadcast
(no input split over the batch, no parameter split) runs the same computation on each of its
ranks: correct, but those ranks do one rank's work, and the user almost always meant data
parallelism and passed the whole batch as plain tensors (a plain tensor is whole on every
rank: graphc never guesses that it is a batch to split). One warning names the stage, its
ranks and the fix.
Requires: infer_sbp.
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch.fx as fx

from ..log import warn_user
from ..meta import META_SBP, META_STAGE
from ..placement import Broadcast, flat


def warn_replicated_stages(gm: fx.GraphModule, meshes: Sequence[tuple]) -> fx.GraphModule:
    spread: Dict[int, bool] = {s: False for s, mesh in enumerate(meshes) if len(flat(mesh)) > 1}
    for node in gm.graph.nodes:
        sig = node.meta.get(META_SBP)
        stage = node.meta.get(META_STAGE)
        if sig is not None and stage in spread and any(not isinstance(s, Broadcast) for s in sig.out):
            spread[stage] = True
    for stage, split in sorted(spread.items()):
        if not split:
            warn_user(
                f"pipeline stage {stage} is placed on ranks {list(flat(meshes[stage]))}, but every "
                "value on it is broadcast, so each of those ranks computes the same thing (one "
                "rank's work, repeated). Fix: for data parallelism pass the batch as "
                "graphc.to_global(x, placement=..., sbp=graphc.sbp.split(0)) with each rank's "
                "rows (a plain tensor is whole on every rank); for tensor parallelism split "
                "parameters; or place the stage on one rank.")
    return gm
