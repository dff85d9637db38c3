"""Bytes a rank sends in one step of its plan, per kind of instruction.

A point-to-point transfer sends its tensors; a boxing conversion (Collective) the bytes it
lists. Gradient collectives are counted as ring algorithms send over d ranks: an all-reduce
of B bytes sends 2 (d-1)/d B (a reduce-scatter, then an all-gather), a ZeRO reduce-scatter or
all-gather of a (padded) bucket of B bytes (d-1)/d B each (See NOTE: ZeRO in
runtime/zero.py). So ZeRO's stages 1 and 2 move what data parallelism moves, up to the
padding of uneven parameters.
"""
from __future__ import annotations

from collections import Counter
from typing import Dict

from .instructions import Instruction
from .plan import ExecutionPlan


def sent_bytes(ins: Instruction) -> int:
    """The bytes this rank sends for `ins` (0 for compute and receives): each kind says its
    own (Instruction.sent_bytes)."""
    return ins.sent_bytes()


def step_bytes(plan: ExecutionPlan) -> Dict[str, int]:
    """Bytes sent per step by instruction word (SEND, ALL_REDUCE, REDUCE_SCATTER, ...)."""
    out: Counter = Counter()
    for ins in plan.instructions:
        n = ins.sent_bytes()
        if n:
            out[ins.word] += n
    return dict(out)
