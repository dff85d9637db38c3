"""insert_boxing: turns every SBP mismatch into explicit conversion nodes.

Invariant: every tensor input of a node arrives in the SBP its signature needs: where
the producer's layout differs, a chain of `ops.conversions.box` nodes (one per mismatched
mesh axis, each carrying META_BOXING) converts it on the consumer's stage; a broadcast
value read by an op with a sharded output gets a `grad_all_reduce` box (identity forward,
all-reduce of its partial_sum gradient backward) unless it is a parameter whose gradient
is synchronised after backward; partial_sum results of build() are left partial, for
insert_output_reduce to sum once per step.
A value read by a stage of another mesh shape arrives there in pieces, in its first
reader's layout (META_ARRIVAL; NOTE: Reshard pieces). A to_global() conversion point stays an identity node after its boxes, on the stage of its
target placement (so a value moved to another placement is returned from there).
Requires: infer_sbp.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Optional, Tuple

import torch.fx as fx

from ..meta import (META_ARRIVAL, META_BOXING, META_GRAD_PARTIAL, META_ROWS, META_SBP, META_STAGE,
                    META_TENSOR, BoxingInfo, SbpSignature)
from ..placement import PartialSum, Split
from ..ops.conversions import RankGroups, box
from ..sbp.boxing import BOXINGS, backward_collective, kind_of
from ..sbp.cost import moved_bytes, tensor_bytes
from ..sbp.layout import B, axis_groups, is_even, mesh_shape, same_shape, split_extent
from .summed_grad_cone import sharded_use


def insert_boxing(gm: fx.GraphModule) -> fx.GraphModule:
    moved: Dict[Tuple[fx.Node, int], fx.Node] = {}  # n-to-m: (value, stage) -> the node sent
    shared: Dict[tuple, fx.Node] = {}  # (value, layout, stage) -> its conversion: NOTE: shared boxes
    for node in list(gm.graph.nodes):
        if node.op == "output":
            continue   # a partial_sum result stays partial: summed once a step (insert_output_reduce)
        sig = node.meta.get(META_SBP)
        if sig is None or node.op in ("placeholder", "get_attr"):
            continue
        for a in list(node.all_input_nodes):
            need = sig.needs(a.name)
            if need is None or a.meta.get(META_TENSOR) is None:
                continue
            sent = _sent_for_other_shape(gm, a, node, need, moved)
            key = (sent, need, node.meta.get(META_STAGE))
            if key not in shared:
                shared[key] = _convert(gm, sent, need, node)
            converted = _grad_reduce(gm, a, shared[key], node, shared)
            if converted is not a:
                node.replace_input_with(a, converted)
                node.meta[META_SBP] = _renamed(node.meta[META_SBP], a.name, converted.name)
    _fuse_gathers(gm)
    gm.graph.lint()
    gm.recompile()
    return gm


def _renamed(sig: SbpSignature, old: str, new: str) -> SbpSignature:
    """The signature with input `old` now read through conversion node `new`."""
    ins = tuple((new if k == old else k, v) for k, v in sig.ins)
    return SbpSignature(sig.mesh, sig.out, ins, sig.fallback)


def _sent_for_other_shape(gm, a: fx.Node, consumer: fx.Node, need: tuple, cache) -> fx.Node:
    """A value read by a stage of another mesh shape (another number of ranks, or a 2-D mesh
    and a 1-D one) moves in pieces (See NOTE: Reshard pieces in graphc/sbp/pieces.py): its
    partial_sum axes are reduced on its own stage first, and it arrives in the layout its
    first reader there needs (a partial_sum need read as broadcast), recorded on the sent
    node as META_ARRIVAL[stage]; lower_plan lists the pieces."""
    src, dst = a.meta[META_SBP], consumer.meta[META_SBP]
    if same_shape(src.mesh, dst.mesh):
        return a
    stage = consumer.meta[META_STAGE]
    if (a, stage) not in cache:
        value, cur = a, src.out
        for axis, s in enumerate(src.out):
            if isinstance(s, PartialSum):
                after = cur[:axis] + (B,) + cur[axis + 1:]
                value = _box_node(gm, value, a, src.mesh, axis, kind_of(s, B), cur, after,
                                  where=consumer)
                cur = after
        arrival = tuple(B if isinstance(s, PartialSum) else s for s in need)
        value.meta.setdefault(META_ARRIVAL, {})[stage] = (arrival, dst.mesh)
        cache[(a, stage)] = value
    return cache[(a, stage)]


def _convert(gm, a: fx.Node, need: tuple, consumer: fx.Node) -> fx.Node:
    cur = a.meta[META_SBP].out
    mesh = consumer.meta[META_SBP].mesh
    if not same_shape(a.meta[META_SBP].mesh, mesh):  # arrived in pieces from another mesh shape
        cur = a.meta[META_ARRIVAL][consumer.meta[META_STAGE]][0]
    value = a
    for axis, d in _conversion_steps(cur, need):
        s = cur[axis]
        after = cur[:axis] + (d,) + cur[axis + 1:]
        kind = kind_of(s, d)
        if kind == "slice" and axis in a.meta.get(META_GRAD_PARTIAL, ()):
            kind = "slice_summed_grad"   # NOTE: Whole values with a summed gradient (summed_grad_cone)
        value = _box_node(gm, value, consumer, mesh, axis, kind, cur, after)
        cur = after
    return value


def _conversion_steps(cur: tuple, need: tuple) -> list:
    """(axis, SBP) conversions from `cur` to `need`, in _conversion_order's order. Where two
    axes split one dim the inner one cuts within the outer one's shard, so a conversion of
    an outer axis that splits, unsplits or moves a dim an inner axis splits would cut (or
    join) in the wrong nesting (a reduce-scatter of the outer axis cutting within the inner
    shard: the sequence split for context parallelism and then the rows for the loss, with
    sequence parallelism on the inner axis). Such inner axes are gathered first (innermost
    first) and cut again later."""
    cur, steps = list(cur), []
    for _ in range(4 * len(need) + 1):
        order = _conversion_order(tuple(cur), need)
        if not order:
            return steps
        axis = order[0]
        dims = {s.dim for s in (cur[axis], need[axis]) if isinstance(s, Split)}
        for inner in reversed(range(axis + 1, len(need))):
            if isinstance(cur[inner], Split) and cur[inner].dim in dims:
                steps.append((inner, B))
                cur[inner] = B
        steps.append((axis, need[axis]))
        cur[axis] = need[axis]
    raise RuntimeError(f"internal: no conversion order from {cur} to {need}")


def _conversion_order(cur: tuple, need: tuple) -> list:
    """The axes to convert, in an order that keeps every shard a box: where two axes split one
    dim, the later axis cuts within the earlier one's shard, so splits are undone innermost
    axis first and made outermost first (a gather of the outer axis first would interleave
    the inner shards, and with uneven shards would not even fit)."""
    undo = [axis for axis in reversed(range(len(need)))
            if isinstance(cur[axis], Split) and cur[axis] != need[axis]]
    return undo + [axis for axis in range(len(need)) if cur[axis] != need[axis] and axis not in undo]


# NOTE: shared boxes
# A value read in the same layout by several ops of a stage is converted once, and a
# broadcast value read by several sharded ops (q, k and v projections of one activation)
# gets one grad_all_reduce: its gradient sums the ops' partial gradients first, so one
# all-reduce in backward serves them all, as Megatron's `f` before the fused QKV GEMM.


def _grad_reduce(gm, a: fx.Node, value: fx.Node, consumer: fx.Node, shared: dict) -> fx.Node:
    meta = a.meta[META_TENSOR]
    if not meta.requires_grad:
        return value
    sig: SbpSignature = consumer.meta[META_SBP]
    synced = a.meta.get(META_GRAD_PARTIAL, ())  # parameters (and their pieces) synced after backward
    cur = sig.needs(a.name)  # the consumer's axes: `a` may come from a mesh of another shape
    axes = tuple(axis for axis in range(len(cur))
                 if sharded_use(consumer, a, axis) and axis not in synced)
    key = ("grad", value, axes, consumer.meta.get(META_STAGE))
    if axes and key not in shared:
        reduced = value
        for axis in axes:
            reduced = _box_node(gm, reduced, consumer, sig.mesh, axis, "grad_all_reduce", cur, cur)
        shared[key] = reduced
    return shared[key] if axes else value


def _fuse_gathers(gm: fx.GraphModule) -> None:
    """An all_gather read only by a grad_all_reduce on its axis becomes one gather_scatter
    box: forward the gather, backward the gradient's reduce-scatter, where the two did an
    all-reduce and a local slice (Megatron's all-gather before a column-parallel Linear under
    sequence parallelism; See NOTE: Sequence parallel). A gather shared with a reader that
    needs no reduction keeps both boxes: that reader's gradient is whole, not partial."""
    for reduce in list(gm.graph.nodes):
        info = reduce.meta.get(META_BOXING)
        if info is None or info.kind != "grad_all_reduce":
            continue
        gather = reduce.args[0]
        found = gather.meta.get(META_BOXING)
        if found is None or found.kind != "all_gather" or found.axis != info.axis \
                or len(gather.users) != 1:
            continue
        gather.args = (gather.args[0], "gather_scatter") + tuple(gather.args[2:])
        n = len(found.groups[0])
        meta = gather.meta[META_TENSOR]
        nbytes = moved_bytes("all_gather", tensor_bytes(meta), n) \
            + moved_bytes("reduce_scatter", tensor_bytes(meta), n)
        gather.meta[META_BOXING] = replace(found, kind="gather_scatter", nbytes=nbytes)
        reduce.replace_all_uses_with(gather)
        for user in gather.users:
            if META_SBP in user.meta:
                user.meta[META_SBP] = _renamed(user.meta[META_SBP], reduce.name, gather.name)
        gm.graph.erase_node(reduce)


def _box_node(gm, value: fx.Node, consumer: fx.Node, mesh: tuple, axis: int, kind: str,
              src: tuple, dst: tuple, where: Optional[fx.Node] = None) -> fx.Node:
    """A box converting `value` on `consumer`'s stage, inserted before `where` (default:
    the consumer itself)."""
    n = mesh_shape(mesh)[axis]
    meta = value.meta[META_TENSOR]
    groups = RankGroups(*axis_groups(mesh, axis))   # See NOTE: Rank groups in code
    src_dim = src[axis].dim if isinstance(src[axis], Split) else -1
    dst_dim = dst[axis].dim if isinstance(dst[axis], Split) else -1
    args = (value, kind, groups, src_dim, dst_dim)
    if src_dim >= 0 and not is_even(meta.shape, src, mesh):  # See NOTE: Uneven splits
        args += (tuple(split_extent(meta.shape, src, mesh, axis, g[0]) for g in groups),)
    with gm.graph.inserting_before(where if where is not None else consumer):
        node = gm.graph.call_function(box, args)
    node.meta[META_STAGE] = consumer.meta.get(META_STAGE, value.meta.get(META_STAGE))
    node.meta[META_TENSOR] = meta
    if META_ROWS in value.meta:  # the same global value: a returned batch sum still merges as one
        node.meta[META_ROWS] = value.meta[META_ROWS]
    node.meta[META_SBP] = SbpSignature(mesh, dst, ((value.name, src),))
    fwd = moved_bytes(BOXINGS[kind].collective, tensor_bytes(meta), n)
    bwd = moved_bytes(backward_collective(kind), tensor_bytes(meta), n) if meta.requires_grad else 0
    note = f"fallback: {_op_name(consumer)} has no SBP rule" if consumer.meta.get(META_SBP) \
        and consumer.meta[META_SBP].fallback else ""
    node.meta[META_BOXING] = BoxingInfo(kind, src, dst, groups, fwd + bwd, note, axis)
    return node


def _op_name(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "?")
    return f"{node.name} ({target})"
