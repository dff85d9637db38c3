"""Boxing cost: bytes one conversion moves, used to choose among valid SBP signatures.

With n ranks on the axis and T the global tensor's bytes (OneFlow's copy-cost model):
same 0; B->S and B->P and S->P local (a tiny cost so that "no conversion" wins ties);
S(i)->S(j) (n-1)/n*T; P->S and S->B (n-1)*T; P->B 2(n-1)*T (totals over the ranks).
conversion_cost, what infer_sbp minimises, adds the gradient's conversion in backward.
"""
from __future__ import annotations

import torch

from ..placement import Broadcast, PartialSum, Split

LOCAL = 1e-3  # a local slice or zero-fill: no bytes move, but it is not free either


def boxing_cost(src, dst, nbytes: int, n: int) -> float:
    """Cost of converting one mesh axis of a value from `src` to `dst` SBP."""
    if src == dst or n == 1:
        return 0.0
    if isinstance(src, Broadcast) or isinstance(dst, PartialSum):
        return LOCAL * nbytes
    if isinstance(src, Split) and isinstance(dst, Split):
        return (n - 1) / n * nbytes
    if isinstance(src, PartialSum) and isinstance(dst, Broadcast):
        return 2 * (n - 1) * nbytes
    return (n - 1) * nbytes  # P->S reduce-scatter, S->B all-gather


COLLECTIVE = 1.0  # one byte per collective launched: equal-byte choices go to fewer collectives


def _whole(s):
    """The layout of a value's gradient (NOTE: gradient layouts): partial_sum's is whole."""
    return Broadcast() if isinstance(s, PartialSum) else s


def _communicates(src, dst, n: int) -> bool:
    return src != dst and n > 1 and not isinstance(src, Broadcast) and not isinstance(dst, PartialSum)


def conversion_cost(src, dst, nbytes: int, n: int, grad: bool) -> float:
    """What a choice of layout costs a value: its boxing forward and, for a value that needs a
    gradient, the dual conversion of the gradient in backward (P->S's all-gather, B->S's
    all-gather; P->B's and B->P's backward move nothing), plus COLLECTIVE per collective."""
    cost = boxing_cost(src, dst, nbytes, n) + COLLECTIVE * _communicates(src, dst, n)
    if grad:
        back_src, back_dst = _whole(dst), _whole(src)
        cost += boxing_cost(back_src, back_dst, nbytes, n) + \
            COLLECTIVE * _communicates(back_src, back_dst, n)
    return cost


def moved_bytes(kind: str, nbytes: int, n: int) -> int:
    """Bytes each rank sends (ring algorithms) for one collective on a global value of `nbytes`."""
    if n == 1:
        return 0
    per = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
           "all_gather": (n - 1) / n, "all_to_all": (n - 1) / (n * n)}
    return int(per.get(kind, 0) * nbytes)


def tensor_bytes(meta) -> int:
    """Bytes of a value with TensorMeta `meta` (its global shape)."""
    numel = 1
    for d in meta.shape:
        numel *= d
    return numel * getattr(torch, meta.dtype).itemsize
