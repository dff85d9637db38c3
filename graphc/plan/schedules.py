"""Compute orders of pipeline schedules: per stage, the forwards and backwards in order.

These are pure functions of (stages, micro-batches); communication is added later by
lowering (`passes/lower_plan.py`). A schedule that splits backward into input-grad and
weight-grad, or runs several chunks per rank, returns more instruction kinds here and
needs nothing else changed.
"""
from __future__ import annotations

from typing import Callable, Dict, List

from ..errors import GraphcError
from .instructions import Backward, Forward, Instruction


def gpipe(stage: int, num_stages: int, num_microbatches: int) -> List[Instruction]:
    """All forwards, then all backwards: every stage holds m micro-batches of activations."""
    m = num_microbatches
    return [Forward(stage, i) for i in range(m)] + [Backward(stage, i) for i in range(m)]


def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> List[Instruction]:
    """1F1B: min(p - s, m) warm-up forwards, then one backward / one forward, then drain.

    Stage s therefore never holds more than min(p - s, m) micro-batches of activations.
    """
    m = num_microbatches
    warmup = min(num_stages - stage, m)
    order: List[Instruction] = [Forward(stage, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Backward(stage, i), Forward(stage, warmup + i)]
    order += [Backward(stage, i) for i in range(m - warmup, m)]
    return order


def forward_only(stage: int, num_stages: int, num_microbatches: int) -> List[Instruction]:
    """Inference: forwards in micro-batch order."""
    return [Forward(stage, i) for i in range(num_microbatches)]


SCHEDULES: Dict[str, Callable[[int, int, int], List[Instruction]]] = {
    "1f1b": one_f_one_b,
    "gpipe": gpipe,
}


def compute_order(schedule: str, stage: int, num_stages: int, num_microbatches: int,
                  training: bool = True) -> List[Instruction]:
    if not training:
        return forward_only(stage, num_stages, num_microbatches)
    if schedule not in SCHEDULES:
        raise GraphcError(f"unknown pipeline schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[schedule](stage, num_stages, num_microbatches)
