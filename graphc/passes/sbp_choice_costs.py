"""What infer_sbp weighs a candidate signature by: the bytes its conversions move, a
declared parameter's penalty, and a whole value widened (passes/infer_sbp.py: _choose)."""
from __future__ import annotations

import operator
from typing import Dict

import torch
import torch.fx as fx

from ..meta import META_TENSOR
from ..placement import Broadcast, PartialSum
from ..sbp.cost import COLLECTIVE, boxing_cost, conversion_cost, tensor_bytes
from ..sbp.layout import B


# A parameter the user declared split (Megatron's column/row layouts) is computed on as
# declared: gathering it instead costs its bytes like any value, and the layout the user
# asked for besides (DECLARED_PENALTY times its conversion cost), so an op reading it takes
# the declared layout whenever one of its candidates can; with tiny activations the bytes
# alone preferred gathering the weights of every layer after the first (HF Llama on tensor
# 2: 87 collectives per micro-batch).
DECLARED_PENALTY = 8.0


def _cost(cand, prod: Dict[fx.Node, object], n: int, paid=frozenset()) -> float:
    """Bytes the candidate's conversions move; a conversion an earlier reader already needs
    is free (insert_boxing shares it: NOTE: shared boxes)."""
    req, _ = cand
    total = 0.0
    for a, r in req.items():
        meta = a.meta.get(META_TENSOR)
        if meta is None or (a, r) in paid:
            continue
        cost = conversion_cost(prod[a], r, tensor_bytes(meta), n, meta.requires_grad)
        if cost and _is_parameter(a) and not isinstance(prod[a], Broadcast):
            cost *= 1 + DECLARED_PENALTY
        total += cost
    return total


def _keeps_parameters(cand, prod: Dict[fx.Node, object]) -> bool:
    """Does the candidate read every parameter in the layout it has?"""
    return all(r == prod[a] for a, r in cand[0].items() if _is_parameter(a))


def _is_parameter(a: fx.Node) -> bool:
    """A parameter as ops read it: its get_attr node, or a piece of one stored in pieces
    (a fused c_attn's q, k and v: See NOTE: fused pieces)."""
    if a.op == "get_attr":
        return True
    whole = a.args[0] if a.target is operator.getitem and a.args else None
    return (isinstance(whole, fx.Node) and whole.target is torch.split
            and isinstance(whole.args[0], fx.Node) and whole.args[0].op == "get_attr")


def _widening(node: fx.Node, cand, prod: Dict[fx.Node, object], n: int) -> float:
    """A partial result carried through an op that widens its dtype (under autocast, a bf16
    row-parallel product plus the float32 residual) is reduced later at the wider size:
    the candidate pays now for the extra bytes of that reduction and its launch, so the
    all-reduce goes before the op, in the narrow dtype, where that is no dearer (Megatron's
    one bf16 all-reduce after its row-parallel layer)."""
    req, out = cand
    meta = node.meta.get(META_TENSOR)
    if not isinstance(out, PartialSum) or meta is None:
        return 0.0
    carried = [a.meta[META_TENSOR] for a, r in req.items() if isinstance(r, PartialSum)
               and isinstance(prod[a], PartialSum) and a.meta.get(META_TENSOR) is not None]
    if not carried:
        return 0.0
    narrow = min(getattr(torch, m.dtype).itemsize for m in carried)
    wide = getattr(torch, meta.dtype).itemsize
    if wide <= narrow:
        return 0.0
    return boxing_cost(PartialSum(), B, tensor_bytes(meta), n) * (1 - narrow / wide) + COLLECTIVE
