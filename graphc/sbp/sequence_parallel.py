"""Sequence parallelism: on a tensor-parallel axis, activations split along the sequence.

NOTE: Sequence parallel
Megatron's tensor parallelism leaves the residual stream whole on every rank of the tensor
axis: the layer norms, dropouts and residual adds between the split matmuls run n times on
the same [B, T, H] values, and an all-reduce after each row-parallel Linear makes them
whole. With `config.enable_sequence_parallel(True)` (Korthikanti et al., Megatron's
`sequence_parallel`) those values are split(1), the sequence dim, on the tensor axis; the
SBP boxing then reads as Megatron's:

    row-parallel out  P -> S(1)   reduce-scatter   (backward: all-gather)
    column-parallel in S(1) -> B  all-gather       (backward: reduce-scatter, fused with the
                                                    gradient's all-reduce by insert_boxing)

Per layer the bytes moved equal the all-reduces' (a reduce-scatter and an all-gather move
what one all-reduce does), and the activations of those regions are 1/n per rank.

It is a preference of infer_sbp, not a separate rewrite: on a stage's tensor axis (a mesh
axis on which one of its parameters is declared split) an activation with rows and a
sequence ([B, T, ...], rows at dim 0) whose cheapest layout is whole (broadcast, or
partial_sum: a row-parallel sum not yet reduced) takes instead the cheapest candidate of
its rule whose output is split(1) and that reads every parameter as laid out, whenever the
rule has one (layer norm over the last dim, elementwise ops, adds, dropout, a broadcast
Linear's rows; not a row-parallel Linear, which would gather its weight). Values
already split (heads inside attention, features between the column- and row-parallel
Linears) keep what bytes chose, and an op without such a candidate stays broadcast, so
every program still computes what it computed before, only laid out differently. Dropout
on a split(1) value draws each shard's own numbers (NOTE: Replica-equal randomness: a
split axis gives each rank its own stream, replicas along other axes the same masks), so
its masks differ from the run without sequence parallelism, as Megatron's do.

Not done here: a column-parallel Linear saves its gathered input whole for backward
(Megatron saves the shard and gathers again in backward), so the saved bytes of those
inputs do not shrink; the layer norms', adds' and dropouts' do (measured in
tests/runtime/test_sequence_parallel.py).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Set

import torch.fx as fx

from ..meta import META_ROWS, META_STAGE, META_TENSOR
from ..placement import PartialSum, Split
from .declared import declared_in

SEQUENCE_DIM = 1  # of [B, T, H]: the batch's rows at dim 0, the sequence next


def tensor_axes(gm: fx.GraphModule) -> Dict[int, Set[int]]:
    """Per stage, the mesh axes on which one of its parameters is declared split."""
    axes: Dict[int, Set[int]] = {}
    declared = declared_in(gm)
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        layout = declared.of(str(node.target))
        if layout is None:
            continue
        split = {axis for axis, s in enumerate(layout.sbp) if isinstance(s, Split)}
        axes.setdefault(node.meta.get(META_STAGE), set()).update(split)
    return axes


def is_sequence_value(node: fx.Node) -> bool:
    """Has the node's value the batch's rows at dim 0 and a sequence dim after them?"""
    meta = node.meta.get(META_TENSOR)
    rows = node.meta.get(META_ROWS)
    return (node.op == "call_function" and meta is not None and len(meta.shape) >= 3
            and (rows is None or rows.dim == 0))


def prefer_sequence_split(node: fx.Node, cands: List[tuple], best: tuple, prod: Dict[fx.Node, object],
                          cost: Callable[[tuple], float], keeps: Callable[[tuple], bool]) -> tuple:
    """`best`, or where it leaves a sequence value whole (broadcast, or partial_sum: a sum
    reduced later) the cheapest candidate that splits it along the sequence and reads every
    parameter as laid out (`keeps`), so a row-parallel Linear stays partial and its
    reduce-scatter goes where its result meets the residual stream (See NOTE: Sequence parallel)."""
    if isinstance(best[1], Split) or not is_sequence_value(node):
        return no_partial_from_split(cands, best, prod, cost)
    seq = [c for c in cands if c[1] == Split(SEQUENCE_DIM) and keeps(c)]
    return min(seq, key=cost) if seq else best


def no_partial_from_split(cands: List[tuple], best: tuple, prod: Dict[fx.Node, object],
                           cost: Callable[[tuple], float], split_only: bool = False) -> tuple:
    """Where the split residual stream leaves the region through an op that cannot keep the
    split (the LM head's logits viewed as [B*T, V]), a partial_sum made of it by zero-padding
    (S -> P, local) defers a reduction of the whole value (an all-reduce of the logits) that
    gathering or re-splitting it now does for half the bytes or less: the cheapest candidate
    that makes nothing partial instead. split_only (context parallelism, where no rank
    should hold the whole sequence's values): the cheapest that keeps the value split."""
    if not isinstance(best[1], PartialSum) or not any(
            isinstance(prod.get(a), Split) and isinstance(r, PartialSum) for a, r in best[0].items()):
        return best
    whole = [c for c in cands if not isinstance(c[1], PartialSum)]
    split = [c for c in whole if isinstance(c[1], Split)]
    if split_only and split:
        return min(split, key=cost)
    return min(whole, key=cost) if whole else best
