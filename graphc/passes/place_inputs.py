"""place_inputs: with set_stage, a GlobalTensor input lives on the stage of its placement.

Invariant: every input given as a GlobalTensor whose placement holds exactly one stage's
ranks has that stage (META_STAGE, why "input"); where the placement holds several (an
interleaved or V layout), META_INPUT_STAGES lists them and annotate_stages places the input
on the latest of them at or before its earliest user, so its value moves from there to the stages
that read it, like any value (in pieces between meshes of other shapes: NOTE: Reshard
pieces). API.md: ranks outside an input's placement pass a tensor whose values are not read,
so an input declared on placement [0, 1] and read by a stage on [2, 3, 4] must come from
[0, 1]; placed by its users instead (annotate_stages' rule 3), the stage's ranks would read
their own unread tensors, a silently wrong result. An input placed on ranks that hold no
stage is refused, naming the stages' placements. Plain tensors (whole on every rank) keep
rule 3: they are placed where their first user runs.
Requires: trace_build; runs before annotate_stages, with set_stage only.
"""
from __future__ import annotations

from typing import Sequence

import torch.fx as fx

from ..errors import GraphcError
from ..meta import META_INPUT_STAGES, META_STAGE, META_STAGE_WHY


def place_inputs(gm: fx.GraphModule, input_layouts: Sequence, stages) -> fx.GraphModule:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_ranks = {}   # V and interleaved layouts put several stages on one placement
    for st in sorted(stages, key=lambda st: st.stage_id):
        by_ranks.setdefault(tuple(sorted(st.ranks)), []).append(st.stage_id)
    for node, layout in zip(placeholders, input_layouts):
        if not layout:
            continue
        ranks = tuple(sorted(layout.placement.flat_ranks))
        if ranks not in by_ranks:
            where = ", ".join(f"stage {st.stage_id} on {list(st.ranks)}" for st in stages)
            raise GraphcError(
                f"input '{node.name}' is a GlobalTensor on ranks {list(ranks)}, which hold no "
                f"pipeline stage ({where}); ranks outside an input's placement pass values "
                "that are not read, so no stage could read it. Fix: to_global the input on "
                "the placement of the stage that reads it first (or pass the whole tensor).")
        if len(by_ranks[ranks]) == 1:
            node.meta[META_STAGE] = by_ranks[ranks][0]
            node.meta[META_STAGE_WHY] = "input"
        else:   # annotate_stages picks among them by the input's users
            node.meta[META_INPUT_STAGES] = tuple(by_ranks[ranks])
    return gm
