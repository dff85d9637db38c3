"""Boxing cost: bytes one conversion moves, used to choose among valid SBP signatures.

The numbers are the boxing table's (sbp/boxing.py). With n ranks on the axis and T the
global tensor's bytes (OneFlow's copy-cost model): same 0; B->S and B->P and S->P local
(a tiny cost so that "no conversion" wins ties); S(i)->S(j) (n-1)/n*T; P->S and S->B
(n-1)*T; P->B 2(n-1)*T (totals over the ranks). conversion_cost, what infer_sbp
minimises, adds the gradient's conversion in backward (the table's dual).
"""
from __future__ import annotations

from typing import Optional

import torch

from .boxing import BOXINGS, kind_of


def boxing_cost(src, dst, nbytes: int, n: int) -> float:
    """Cost of converting one mesh axis of a value from `src` to `dst` SBP (the table's total)."""
    if src == dst or n == 1:
        return 0.0
    return BOXINGS[kind_of(src, dst)].total(n) * nbytes


COLLECTIVE = 1.0  # one byte per collective launched: equal-byte choices go to fewer collectives


def conversion_cost(src, dst, nbytes: int, n: int, grad: bool) -> float:
    """What a choice of layout costs a value: its boxing forward and, for a value that needs a
    gradient, its dual conversion of the gradient in backward (P->S's all-gather, B->S's
    all-gather; P->B's and B->P's backward move nothing), plus COLLECTIVE per collective."""
    if src == dst or n == 1:
        return 0.0
    box = BOXINGS[kind_of(src, dst)]
    cost = box.total(n) * nbytes + COLLECTIVE * (box.collective is not None)
    if grad and box.dual is not None:
        dual = BOXINGS[box.dual]
        cost += dual.total(n) * nbytes + COLLECTIVE * (dual.collective is not None)
    return cost


def moved_bytes(kind: Optional[str], nbytes: int, n: int) -> int:
    """Bytes each rank sends (ring algorithms) for one collective on a global value of `nbytes`."""
    if n == 1 or kind not in BOXINGS:
        return 0
    return int(BOXINGS[kind].sent(n) * nbytes)


def tensor_bytes(meta) -> int:
    """Bytes of a value with TensorMeta `meta` (its global shape)."""
    numel = 1
    for d in meta.shape:
        numel *= d
    return numel * getattr(torch, meta.dtype).itemsize
