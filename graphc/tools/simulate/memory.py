"""Memory accounting of a simulated step: live micro-batches and peak activation bytes.

NOTE: Activation bytes
A rank's peak activation bytes (`RankSummary.peak_activation_bytes`) walk its compute in
plan order: a forward keeps its stage's activation bytes for that micro-batch (only the
stage's input bytes when the plan's checkpoint mode recomputes that micro-batch); a
backward of a checkpointed one first recomputes them (its peak counts them back), and the
backward, or the W half of a split one, frees them; an I half recomputes and keeps them for
its W. Inference holds one micro-batch at a time.
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

from ...plan.instructions import Backward, BackwardInput, BackwardWeight, Forward, Recv
from ...plan.plan import ExecutionPlan, checkpointed_microbatches
from ..cost_model import CostModel

# activations a kind adds to the micro-batches a rank holds: a forward keeps its micro-batch
# until the backward (whole, or its weight half) frees it
_LIVE = {"forward": 1, "backward": -1, "backward_weight": -1}


def activation_peak(plan: ExecutionPlan, costs: CostModel) -> int:
    """Peak bytes of saved activations on one rank over its step (NOTE: Activation bytes)."""
    act, inputs = costs.activation_bytes, stage_input_bytes(plan, costs)
    if not plan.training:       # inference frees each micro-batch's activations at once
        return max((act.get(s, 0) for s in plan.local_stages), default=0)
    recomputed = checkpointed_microbatches(plan.checkpointing, plan.num_microbatches)
    held: Dict[Tuple[int, int], int] = {}
    live = peak = 0
    for ins in plan.instructions:
        for part in ins.parts:
            if not isinstance(part, (Forward, Backward, BackwardInput, BackwardWeight)):
                continue
            key, whole = (part.stage, part.microbatch), act.get(part.stage, 0)
            if isinstance(part, Forward):
                held[key] = inputs.get(part.stage, 0) if part.microbatch in recomputed else whole
                live += held[key]
            elif isinstance(part, BackwardInput):   # recomputes; W still reads what I saved
                live += whole - held.get(key, 0)
                held[key] = whole
            else:
                if isinstance(part, Backward):      # a checkpointed one recomputes first
                    peak = max(peak, live + whole - held.get(key, 0))
                live -= held.pop(key, 0)
            peak = max(peak, live)
    return peak


def stage_input_bytes(plan: ExecutionPlan, costs: CostModel) -> Dict[int, int]:
    """Bytes a checkpointed micro-batch keeps per stage: the measured inputs where known,
    else what the stage receives per micro-batch (its activations from the stage before)."""
    out = dict(costs.input_bytes)
    for ins in plan.instructions:
        if isinstance(ins, Recv) and ins.direction == "F" and ins.microbatch == 0 \
                and ins.stage not in costs.input_bytes:
            out[ins.stage] = out.get(ins.stage, 0) + sum(t.nbytes for t in ins.tensors)
    return out


def peak_live_microbatches(kinds: Sequence[str], training: bool) -> int:
    """The most micro-batches whose activations a rank holds at once, from the timeline
    kinds of its instructions in order."""
    live = peak = 0
    for kind in kinds:
        if kind == "overlap":       # its forward's activations exist before its backward
            peak = max(peak, live + 1)
        live += _LIVE.get(kind, 0)
        peak = max(peak, live)
    if not training:
        peak = min(peak, 1)     # inference frees each micro-batch's activations at once
    return peak
