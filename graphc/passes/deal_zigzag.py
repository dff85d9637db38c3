"""deal_zigzag: load-balanced context parallelism deals the sequence zig-zag inside the step.

Invariant: on every rank group where attention with `load_balance=True` splits a sequence of
T positions over n ranks, each value split there along a dim of size T is dealt zig-zag
(rank k holds chunks k and 2n-1-k of 2n; See NOTE: Zig-zag dealing in graphc/sbp/layout.py):
every conversion of such a dim carries `zigzag` flags (gathers put it back in order, slices
and all-to-alls deal it anew), the attention call reads `load_balance=True` (the ring's
causal pairs by true position, Ulysses' sequence put in order as it becomes whole), a graph
input or parameter split there arrives dealt contiguously as the user passed it and is
redealt once (a `redeal` box), and a returned value leaves dealt contiguously again. Every
other op is per position along that dim, so it computes on whichever positions it holds; an
op that reads the dim split and writes a split of another size (it mixes the sequence with
another dim) would read positions in the wrong order and is refused.
Requires: localize_ops (attention is context_parallel_attention on its groups).
"""
from __future__ import annotations

from typing import Dict, Optional, Set, Tuple

import torch.fx as fx

from ..errors import GraphcError
from ..meta import META_BOXING, META_CONTEXT_PARALLEL, META_SBP, META_STAGE, META_TENSOR, BoxingInfo, SbpSignature
from ..ops.context_parallel import context_parallel_attention
from ..ops.conversions import RankGroups, box
from ..placement import Split
from ..sbp.boxing import BOXINGS, backward_collective
from ..sbp.cost import moved_bytes, tensor_bytes
from ..sbp.layout import axis_groups, mesh_shape
from .user_lines import node_line

Balanced = Dict[Tuple[int, ...], Set[int]]   # a rank group -> the sequence lengths dealt zig-zag on it


def deal_zigzag(gm: fx.GraphModule) -> fx.GraphModule:
    balanced = _balanced_groups(gm)
    if not balanced:
        return gm
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is box:
            _flag_box(node, balanced)
        elif node.op in ("placeholder", "get_attr"):
            _redeal_entry(gm, node, balanced)
        elif node.op == "output":
            _redeal_exit(gm, node, balanced)
        elif node.op in ("call_function", "call_method") and node.target is not context_parallel_attention:
            _check_per_position(node, balanced)
    gm.graph.lint()
    gm.recompile()
    return gm


def _balanced_groups(gm: fx.GraphModule) -> Balanced:
    """The groups of every load-balanced attention call, each call marked to deal zig-zag."""
    found: Balanced = {}
    for node in gm.graph.nodes:
        cp = node.meta.get(META_CONTEXT_PARALLEL)
        if node.target is not context_parallel_attention or cp is None or not cp.load_balance:
            continue
        groups, seq_len = node.args[4], node.args[6]
        n = len(groups[0])
        if seq_len % (2 * n):
            raise GraphcError(
                f"attention '{node.name}' ({node_line(node)}): set_context_parallel(load_balance=True) "
                f"cuts its sequence of {seq_len} positions into 2 x {n} equal chunks (rank k holds "
                f"chunks k and {2 * n - 1}-k), and {seq_len} does not divide by {2 * n}. Fix: pad the "
                f"sequence to a multiple of {2 * n}, or load_balance=False.")
        node.kwargs = {**node.kwargs, "load_balance": True}
        for g in groups:
            found.setdefault(tuple(g), set()).add(seq_len)
    return found


def _zig_axes(sig: SbpSignature, balanced: Balanced):
    """(mesh axis, its groups, the zig-zag lengths there) for each balanced axis of the mesh."""
    for axis in range(len(mesh_shape(sig.mesh))):
        groups = axis_groups(sig.mesh, axis)
        if tuple(groups[0]) in balanced:
            yield axis, groups, balanced[tuple(groups[0])]


def _zig_dim(shape, sbp: tuple, axis: int, lengths: Set[int]) -> Optional[int]:
    """The dim that `sbp` splits on `axis` when it is a dealt sequence (its size one of
    `lengths`), else None."""
    s = sbp[axis]
    return s.dim if isinstance(s, Split) and shape[s.dim] in lengths else None


def _flag_box(node: fx.Node, balanced: Balanced) -> None:
    groups, src_dim, dst_dim = node.args[2], node.args[3], node.args[4]
    lengths = balanced.get(tuple(groups[0]))
    if not lengths:
        return
    shape = node.meta[META_TENSOR].shape
    zigzag = (src_dim >= 0 and shape[src_dim] in lengths, dst_dim >= 0 and shape[dst_dim] in lengths)
    if any(zigzag):
        node.kwargs = {**node.kwargs, "zigzag": zigzag}


def _redeal_entry(gm: fx.GraphModule, node: fx.Node, balanced: Balanced) -> None:
    """An input (or parameter) split contiguously along a sequence: redealt zig-zag once."""
    sig, meta = node.meta.get(META_SBP), node.meta.get(META_TENSOR)
    if sig is None or meta is None or not node.users:
        return
    value = node
    for axis, groups, lengths in _zig_axes(sig, balanced):
        dim = _zig_dim(meta.shape, sig.out, axis, lengths)
        if dim is None:
            continue
        users = list(value.users)
        dealt = _redeal_node(gm, value, sig, axis, groups, dim, (False, True), after=value)
        for user in users:
            user.replace_input_with(value, dealt)
            if META_SBP in user.meta:
                user.meta[META_SBP] = _renamed(user.meta[META_SBP], value.name, dealt.name)
        value = dealt


def _redeal_exit(gm: fx.GraphModule, output: fx.Node, balanced: Balanced) -> None:
    """A returned value split along a sequence: dealt contiguously again, as the user reads it."""
    for value in list(output.all_input_nodes):
        sig, meta = value.meta.get(META_SBP), value.meta.get(META_TENSOR)
        if sig is None or meta is None or not hasattr(meta, "shape"):
            continue
        back = value
        for axis, groups, lengths in _zig_axes(sig, balanced):
            dim = _zig_dim(meta.shape, sig.out, axis, lengths)
            if dim is not None:
                back = _redeal_node(gm, back, sig, axis, groups, dim, (True, False), before=output)
        if back is not value:
            output.replace_input_with(value, back)


def _redeal_node(gm, value: fx.Node, sig: SbpSignature, axis: int, groups, dim: int, zigzag: tuple,
                 after: fx.Node = None, before: fx.Node = None) -> fx.Node:
    meta = value.meta[META_TENSOR]
    n = len(groups[0])
    where = gm.graph.inserting_after(after) if after is not None else gm.graph.inserting_before(before)
    with where:
        node = gm.graph.call_function(box, (value, "redeal", RankGroups(*groups), dim, dim), {"zigzag": zigzag})
    node.meta[META_STAGE] = value.meta.get(META_STAGE)
    node.meta[META_TENSOR] = meta
    node.meta[META_SBP] = SbpSignature(sig.mesh, sig.out, ((value.name, sig.out),))
    nbytes = moved_bytes(BOXINGS["redeal"].collective, tensor_bytes(meta), n)
    if meta.requires_grad:
        nbytes += moved_bytes(backward_collective("redeal"), tensor_bytes(meta), n)
    note = "load balance: dealt zig-zag" if zigzag[1] else "load balance: dealt back in order"
    node.meta[META_BOXING] = BoxingInfo("redeal", sig.out, sig.out, RankGroups(*groups), nbytes, note, axis)
    return node


def _renamed(sig: SbpSignature, old: str, new: str) -> SbpSignature:
    return SbpSignature(sig.mesh, sig.out, tuple((new if name == old else name, s) for name, s in sig.ins),
                        sig.fallback)


def _check_per_position(node: fx.Node, balanced: Balanced) -> None:
    """Refuses an op that reads a dealt sequence and writes a split of another dim size on the
    same axis: it would treat zig-zag positions as contiguous ones."""
    sig = node.meta.get(META_SBP)
    if sig is None or sig.fallback:
        return
    shapes = {a.name: getattr(a.meta.get(META_TENSOR), "shape", None) for a in node.all_input_nodes}
    out_shape = getattr(node.meta.get(META_TENSOR), "shape", None)
    for axis, _, lengths in _zig_axes(sig, balanced):
        kinds = set()
        for shape, sbp in [(shapes.get(name), s) for name, s in sig.ins] + [(out_shape, sig.out)]:
            if shape is not None and isinstance(sbp[axis], Split):
                kinds.add(_zig_dim(shape, sbp, axis, lengths) is not None)
        if len(kinds) > 1:
            raise GraphcError(
                f"'{node.name}' ({node_line(node)}) reads a sequence split over ranks {sig.mesh} dealt "
                "zig-zag for load balance (set_context_parallel(load_balance=True)) and splits a dim "
                "of another size there: it mixes positions with another dim, and would read them "
                "out of order. Fix: load_balance=False, or keep the sequence dim apart in this op.")
