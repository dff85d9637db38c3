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
    live = _LiveBytes(act, inputs, checkpointed_microbatches(plan.checkpointing, plan.num_microbatches))
    for ins in plan.instructions:
        for part in ins.parts:
            effect = _ACTIVATION_EFFECTS.get(part.runs)
            if effect is not None:
                effect(live, part)
                live.peak = max(live.peak, live.live)
    return live.peak


class _LiveBytes:
    """The activation bytes a rank holds per (stage, micro-batch) as its computes run."""

    def __init__(self, act: Dict[int, int], inputs: Dict[int, int], recomputed):
        self.act, self.inputs, self.recomputed = act, inputs, recomputed
        self.held: Dict[Tuple[int, int], int] = {}
        self.live = self.peak = 0

    def forward(self, part) -> None:
        key = (part.stage, part.microbatch)
        self.held[key] = self.inputs.get(part.stage, 0) if part.microbatch in self.recomputed \
            else self.act.get(part.stage, 0)
        self.live += self.held[key]

    def backward_input(self, part) -> None:
        """Recomputes a checkpointed micro-batch; W still reads what I saved."""
        key = (part.stage, part.microbatch)
        self.live += self.act.get(part.stage, 0) - self.held.get(key, 0)
        self.held[key] = self.act.get(part.stage, 0)

    def backward(self, part) -> None:
        """A checkpointed micro-batch is recomputed first, then everything is freed."""
        key = (part.stage, part.microbatch)
        self.peak = max(self.peak, self.live + self.act.get(part.stage, 0) - self.held.get(key, 0))
        self.live -= self.held.pop(key, 0)

    def backward_weight(self, part) -> None:
        self.live -= self.held.pop((part.stage, part.microbatch), 0)


# each compute part's effect on the activations held, by its run entry (as the runtime dispatches)
_ACTIVATION_EFFECTS = {Forward.runs: _LiveBytes.forward, BackwardInput.runs: _LiveBytes.backward_input,
                       Backward.runs: _LiveBytes.backward, BackwardWeight.runs: _LiveBytes.backward_weight}


def stage_input_bytes(plan: ExecutionPlan, costs: CostModel) -> Dict[int, int]:
    """Bytes a checkpointed micro-batch keeps per stage: the measured inputs where known,
    else what the stage receives per micro-batch (its activations from the stage before)."""
    out = dict(costs.input_bytes)
    for ins in plan.instructions:
        if ins.runs == Recv.runs and ins.direction == "F" and ins.microbatch == 0 \
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
