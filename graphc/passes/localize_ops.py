"""localize_ops: rewrites ops that read global sizes into their form on local components.

Invariant: run on each rank's local components, every node computes its local component
of the global value its signature names: a mean, cross_entropy or mse_loss mean over a
split dim divides a local sum by the global count; view/reshape/unflatten get local target
shapes (a dim split unevenly takes its input's local size at run time); size()/shape/numel() of a split value read the global sizes; an embedding with a
vocabulary-split table masks indices outside this rank's rows; attention over a split
sequence exchanges keys and values (NOTE: Context parallel); experts split over a mesh
axis exchange the tokens with the ranks holding their experts (See NOTE: Expert parallel);
a parameter stored in pieces is cut at the pieces' local sizes.
Requires: insert_boxing (inputs already arrive in the signature's SBP).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..errors import GraphcError
from ..log import warn_user
from ..meta import META_CONTEXT_PARALLEL, META_PIECES, META_SBP, META_TENSOR
from ..ops.context_parallel import context_parallel_attention
from ..placement import PartialSum, Split
from ..ops.conversions import RankGroups, box, vocab_parallel_embedding
from ..ops.experts import expert_parallel
from ..sbp.experts import moe_experts
from ..sbp.layout import axis_groups, flat, fmt, local_shape
from ..sbp.local_ops import (cross_entropy_partial, global_numel, global_size, mean_as_partial,
                             mse_loss_partial, reshape_keeping)
from .user_lines import node_line

_MEAN = (torch.mean, "mean")
_RESHAPE = (torch.reshape, "view", "reshape")
_UNFLATTEN = (torch.unflatten, "unflatten")
_SIZE = ("size", "numel", "nelement")
_EXPAND = ("expand", torch.broadcast_to, "broadcast_to")


def localize_ops(gm: fx.GraphModule, expert_capacity: Optional[float] = None) -> fx.GraphModule:
    """expert_capacity: set_expert_capacity's factor for expert-parallel layers (None: dropless)."""
    for node in list(gm.graph.nodes):
        sig = node.meta.get(META_SBP)
        if sig is None or node.op not in ("call_function", "call_method") or sig.fallback:
            continue
        if not any(isinstance(s, (Split, PartialSum)) for _, ins in sig.ins for s in ins) and \
                not any(isinstance(s, Split) for s in sig.out):
            continue
        if node.target in _MEAN:
            _localize_mean(gm, node, sig)
        elif node.target is F.cross_entropy or node.target is F.mse_loss:
            _localize_loss(gm, node, sig)
        elif node.target in _RESHAPE:
            _localize_reshape(node, sig)
        elif node.target is F.embedding:
            _localize_embedding(node, sig)
        elif node.target in _UNFLATTEN:
            _localize_unflatten(gm, node, sig)
        elif node.target in _SIZE or (node.target is getattr and node.args[1] == "shape"):
            _localize_size(gm, node, sig)
        elif node.target in _EXPAND:
            _localize_expand(node, sig)
        elif node.target is F.scaled_dot_product_attention and META_CONTEXT_PARALLEL in node.meta:
            _localize_attention(node, sig)
        elif node.target is moe_experts:
            _localize_experts(node, sig, expert_capacity)
        elif node.target is torch.split and META_PIECES in getattr(node.args[0], "meta", {}):
            _localize_pieces(node, sig)
    if expert_capacity is not None:
        _warn_capacity_unused(gm)
    gm.graph.lint()
    gm.recompile()
    return gm


def _warn_capacity_unused(gm: fx.GraphModule) -> None:
    """set_expert_capacity acts on expert-parallel layers only; with none the program runs
    dropless, as eager does, and the user is told so (See NOTE: Expert capacity)."""
    if not any(n.target is expert_parallel for n in gm.graph.nodes):
        warn_user("config.set_expert_capacity has no effect here: no experts are split over "
                  "ranks (graphc.to_global(experts, sbp=split(0)) on an axis), so every expert "
                  "layer runs dropless, as eager does.")


def _localize_pieces(node: fx.Node, sig) -> None:
    """torch.split of a parameter stored in pieces into those pieces cuts the local component
    at each piece's local size (See NOTE: fused pieces)."""
    x, sizes, dim = node.args
    pieces = x.meta[META_PIECES]
    need = sig.needs(x.name)
    if any(isinstance(s, Split) and s.dim == dim for s in need):
        node.args = (x, pieces.local_sizes(x.meta[META_TENSOR].shape, need, sig.mesh), dim)


def _localize_expand(node: fx.Node, sig) -> None:
    """expand to global sizes: a split input dim is never expanded (sbp/rules.expand), so its
    size becomes -1 (keep the input's, the local shard's); a dim expanded into a split output
    takes the shard's size."""
    x = node.args[0]
    split = _split_dims(sig, x.name)
    sizes = list(node.args[1:]) if len(node.args) > 2 or isinstance(node.args[1], int) else list(node.args[1])
    off = len(sizes) - len(x.meta[META_TENSOR].shape)
    shard = local_shape(node.meta[META_TENSOR].shape, sig.out, sig.mesh)
    local = [-1 if d - off in split else shard[d] if shard[d] != full and n != -1 else n
             for d, (n, full) in enumerate(zip(sizes, node.meta[META_TENSOR].shape))]
    node.args = (x, tuple(local))


def _split_dims(sig, name: str) -> set:
    return {s.dim for s in (sig.needs(name) or ()) if isinstance(s, Split)}


def _localize_mean(gm, node: fx.Node, sig) -> None:
    x = node.args[0]
    shape = x.meta[META_TENSOR].shape
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    dims = list(range(len(shape))) if dim is None else \
        [d % len(shape) for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
    if not _split_dims(sig, x.name) & set(dims):
        return
    count = math.prod(shape[d] for d in dims)
    _replace(gm, node, mean_as_partial, (x, dim, bool(keepdim), count), {})


def _localize_loss(gm, node: fx.Node, sig) -> None:
    x = node.args[0]
    reduction = node.kwargs.get("reduction", "mean")
    if reduction != "mean" or not _split_dims(sig, x.name):
        return
    shape = x.meta[META_TENSOR].shape
    if node.target is F.cross_entropy:
        count = math.prod(shape) // shape[1] if len(shape) >= 2 else 1
        fn = cross_entropy_partial
    else:
        count, fn = math.prod(shape), mse_loss_partial
    kwargs = {k: v for k, v in node.kwargs.items() if k != "reduction"}
    _replace(gm, node, fn, (node.args[0], node.args[1], count), kwargs)


def _localize_reshape(node: fx.Node, sig) -> None:
    if not any(isinstance(s, Split) for s in sig.out):
        return
    _check_shards_reshape(node, sig)
    kept = _uneven_dims(node, sig)
    if kept:
        node.target, node.op = reshape_keeping, "call_function"
        node.args, node.kwargs = (node.args[0], local_shape(node.meta[META_TENSOR].shape, sig.out,
                                                            sig.mesh), kept), {}
        return
    shape = local_shape(node.meta[META_TENSOR].shape, sig.out, sig.mesh)
    node.args = (node.args[0], tuple(shape)) if node.target is torch.reshape else \
        (node.args[0], *shape)
    node.kwargs = {}


def _check_shards_reshape(node: fx.Node, sig) -> None:
    """Each rank's shard of the input must hold as many elements as its shard of the output.
    A dim split over two mesh axes (rows over data and context ranks) is cut twice: each
    axis's rule saw the whole dim divide evenly, but the inner axis cuts an outer shard that
    may not (2 rows over 2 x 2 ranks: 1 row cut in 2). Refused here, before a rank's view
    fails mid-run with a raw size mismatch."""
    x = node.args[0]
    shape_in, shape_out = x.meta[META_TENSOR].shape, node.meta[META_TENSOR].shape
    need = sig.needs(x.name)
    for r in flat(sig.mesh):
        held = math.prod(local_shape(shape_in, need, sig.mesh, r))
        made = math.prod(local_shape(shape_out, sig.out, sig.mesh, r))
        if held != made:
            split = [s for s in need if isinstance(s, Split)]
            dims = sorted({s.dim for s in split})
            sizes = ", ".join(f"dim {d} of size {shape_in[d]}" for d in dims)
            raise GraphcError(
                f"{node_line(node)}: this reshape of a value of shape {tuple(shape_in)} laid out "
                f"as {fmt(need)} on ranks {list(flat(sig.mesh))} needs equal shards, but rank {r} "
                f"holds {held} elements where its part of the result has {made} ({sizes} is cut "
                f"over several mesh axes into unequal pieces). Fix: make the batch's rows "
                f"(and sequence) divisible by the number of ranks that split them, or split "
                f"fewer axes along the same dim.")


def _localize_unflatten(gm, node: fx.Node, sig) -> None:
    """unflatten's -1 would be solved from the local size: reshape to the local shape instead."""
    if any(isinstance(s, Split) for s in sig.out):
        shape = local_shape(node.meta[META_TENSOR].shape, sig.out, sig.mesh)
        kept = _uneven_dims(node, sig)
        if kept:
            _replace(gm, node, reshape_keeping, (node.args[0], shape, kept), {})
        else:
            _replace(gm, node, torch.reshape, (node.args[0], tuple(shape)), {})


def _uneven_dims(node: fx.Node, sig) -> tuple:
    """(output dim, input dim) of each split dim whose shards differ by rank: a reshape keeps
    such a dim as it is (rules.reshape), so it takes the input's local size at run time."""
    x = node.args[0]
    shape, need = node.meta[META_TENSOR].shape, sig.needs(x.name)
    sizes = {local_shape(shape, sig.out, sig.mesh, r) for r in flat(sig.mesh)}
    return tuple((s.dim, d.dim) for s, d in zip(sig.out, need)
                 if isinstance(s, Split) and len({size[s.dim] for size in sizes}) > 1)


def _localize_size(gm, node: fx.Node, sig) -> None:
    """size()/shape/numel() of a split value read the global (per micro-batch) sizes."""
    x = node.args[0]
    if not _split_dims(sig, x.name):
        return
    shape = tuple(x.meta[META_TENSOR].shape)
    if node.target == "size":
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        _replace(gm, node, global_size, (x, shape, dim), {})
    elif node.target is getattr:
        _replace(gm, node, global_size, (x, shape, None), {})
    else:
        _replace(gm, node, global_numel, (x, math.prod(shape)), {})


def _localize_embedding(node: fx.Node, sig) -> None:
    idx, w = node.args[0], node.args[1]
    need = sig.needs(w.name)
    axes = [a for a, s in enumerate(need) if isinstance(s, Split) and s.dim == 0]
    if not axes:
        return
    node.target = vocab_parallel_embedding
    node.args = (idx, w, axis_groups(sig.mesh, axes[0]), w.meta[META_TENSOR].shape[0])
    node.kwargs = {}


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _localize_attention(node: fx.Node, sig) -> None:
    """Attention whose queries are split along the sequence: its context-parallel form on
    the axis that splits them (See NOTE: Context parallel)."""
    seq = len(node.meta[META_TENSOR].shape) - 2
    axes = [a for a, s in enumerate(sig.out) if s == Split(seq)]
    if not axes:
        return
    if len(axes) > 1:
        raise GraphcError(f"attention '{node.name}': its sequence is split over {len(axes)} mesh axes "
                          f"({sig.out}); context parallelism splits it over one. Fix: split the "
                          "inputs' sequence (split(1)) on one axis of the placement only.")
    given = dict(zip(_SDPA_ARGS, node.args), **node.kwargs)
    cp = node.meta[META_CONTEXT_PARALLEL]
    node.target = context_parallel_attention
    node.args = (given["query"], given["key"], given["value"], given.get("attn_mask"),
                 axis_groups(sig.mesh, axes[0]), cp.method, node.meta[META_TENSOR].shape[seq])
    node.kwargs = {"is_causal": bool(given.get("is_causal", False)), "scale": given.get("scale"),
                   "enable_gqa": bool(given.get("enable_gqa", False))}


def _localize_experts(node: fx.Node, sig, capacity: Optional[float] = None) -> None:
    """Experts split over a mesh axis exchange the tokens there (See NOTE: Expert parallel)."""
    gate_up = node.args[3]
    axes = [a for a, s in enumerate(sig.needs(gate_up.name)) if isinstance(s, Split)]
    weight = _read_parameter(gate_up)
    layer = weight.target.rsplit(".", 1)[0] if weight.op == "get_attr" else weight.name
    experts = weight.meta[META_TENSOR].shape[0]
    declared = weight.meta.get(META_SBP)
    if not axes and declared is not None and any(isinstance(s, Split) for s in declared.out):
        raise GraphcError(
            f"the experts '{layer}' are declared {fmt(declared.out)} on ranks {declared.mesh}, but their "
            f"{experts} experts do not divide evenly over that axis's ranks (or its tokens cannot "
            "split there): expert parallelism gives each rank the same number of experts, and "
            "gathering them instead would hold every expert on every rank. Fix: a number of "
            "experts divisible by the expert-parallel ranks, or declare the experts broadcast.")
    if not axes:
        return
    if len(axes) > 1:
        raise GraphcError(
            f"the experts '{layer}' are split over {len(axes)} mesh axes "
            f"({fmt(sig.needs(gate_up.name))}); expert parallelism splits them over one axis. Fix: "
            "declare the experts' sbp split(0) on one axis and broadcast on the others.")
    node.target = expert_parallel
    node.kwargs = {**node.kwargs, "groups": RankGroups(*axis_groups(sig.mesh, axes[0])),
                   "num_experts": experts, "layer": layer}
    if capacity is not None:   # NOTE: Expert capacity (ops/expert_capacity.py)
        node.kwargs = {**node.kwargs, "capacity": capacity}


def _read_parameter(node: fx.Node) -> fx.Node:
    """The get_attr a parameter's value comes from, through the conversions insert_boxing put
    before its reader."""
    while node.op == "call_function" and node.target is box:
        node = node.args[0]
    return node


def _replace(gm, node: fx.Node, fn, args, kwargs) -> None:
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(fn, args, kwargs)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
