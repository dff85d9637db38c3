"""A column-parallel Linear whose output is only cut into pieces becomes one linear per
piece (decompose_modules' rewrite for fused q/k/v and gate/up projections).

NOTE: fused pieces
nanoGPT computes q, k, v with one Linear(C, 3C) and cuts its output:
`q, k, v = c_attn(x).split(C, dim=2)`; Phi-3 slices its fused `qkv_proj` by position,
`qkv[..., :q_end]`, `qkv[..., q_end:k_end]`, `qkv[..., k_end:]`, and chunks `gate_up_proj`.
Declared column-parallel (weight split(0)), a plain contiguous shard would give rank 0 all
of q and half of k, and no rank a whole head. So, as Megatron stores its fused QKV weight,
graphc stores such a weight (and a split bias) in pieces: rank r holds shard r of each of
the k pieces, concatenated (META_PIECES = sbp.layout.Pieces(sizes, 0) on its get_attr node).
The Linear becomes one linear per piece on `torch.split(w, sizes, 0)`, whose local form cuts
the local component at the pieces' local sizes (localize_ops), so every piece comes out
split(-1) with no communication. Under grouped-query attention the pieces differ (Phi-3 with
4 query and 2 key/value heads: q 4 heads wide, k and v 2 each); rank r then holds query
heads r*H/n.. and key/value heads r*K/n.., the ones its query heads read after repeat_kv,
as Megatron's grouped QKV does. The layout is used only when the Linear is called once, its
output is used by nothing but that cut into pieces along the last dim (split, chunk, or
static slices that tile it), each divisible by the ranks, and no other module holds its
weight. checkpoint/graph_state.py shards and gathers it piece by
piece, so full_state_dict() and the user's module see the usual layout; graph.state_dict()
holds the pieced local component (as Megatron's checkpoints do).
"""
from __future__ import annotations

import operator
from typing import List, Optional, Tuple

import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..meta import META_TENSOR
from ..placement import Broadcast, Split
from ..sbp.declared import declared_in
from ..sbp.layout import mesh_shape
from .module_nodes import copy_meta, param_pieces

Cut = Tuple[List[fx.Node], List[fx.Node]]   # (the k pieces in order, the nodes that cut them)


def fused_linear(gm, node: fx.Node, mod: nn.Module, mesh: tuple):
    """One linear per piece of the weight for a column-parallel Linear whose output is only
    cut into pieces (See NOTE: fused pieces). None when the pattern does not hold."""
    cut = _pieced_cut(gm, node, mod, mesh)
    if cut is None:
        return None
    pieces, cutters = cut
    sizes = [piece.meta[META_TENSOR].shape[-1] for piece in pieces]
    x = node.args[0]
    ws = param_pieces(gm, node, "weight", mod.weight, sizes)
    bs = param_pieces(gm, node, "bias", mod.bias, sizes) if mod.bias is not None else [None] * len(sizes)
    outs = []
    for i, piece in enumerate(pieces):
        outs.append(copy_meta(node, gm.graph.call_function(
            F.linear, (x, ws[i]) + ((bs[i],) if bs[i] is not None else ())), piece.meta[META_TENSOR]))
        piece.replace_all_uses_with(outs[-1])
    for done in pieces + cutters:
        gm.graph.erase_node(done)
    return outs[0]  # the module's node is left without users and erased by the caller


def _pieced_cut(gm, node: fx.Node, mod: nn.Module, mesh: tuple) -> Optional[Cut]:
    """The pieces if `node` calls a Linear with weight split(0) on one mesh axis (bias alike
    or whole), once, and its output is only cut into k >= 2 pieces along the last dim, each
    divisible by the axis' ranks; else None."""
    if type(mod) is not nn.Linear or len(node.args) != 1 or node.kwargs:
        return None
    declared = declared_in(gm)
    layout = declared.of(f"{node.target}.weight")
    axes = [a for a, s in enumerate(layout[1]) if isinstance(s, Split)] if layout else []
    if len(axes) != 1 or layout[1][axes[0]].dim != 0:
        return None
    bias = declared.of(f"{node.target}.bias") if mod.bias is not None else None
    if bias and bias[1] not in (layout[1], tuple(Broadcast() for _ in layout[1])):
        return None
    calls = [u for u in gm.graph.nodes if u.op == "call_module" and u.target == node.target]
    holders = [q for _, q in gm.named_parameters(remove_duplicate=False) if q is mod.weight]
    if len(calls) != 1 or len(holders) != 1:
        return None
    cut = _split_cut(node, mod.out_features) or _sliced_cut(node, mod.out_features)
    n = mesh_shape(mesh)[axes[0]]
    if cut is None or len(cut[0]) < 2 or any(p.meta[META_TENSOR].shape[-1] % n for p in cut[0]):
        return None
    return cut


def _split_cut(src: fx.Node, size: int) -> Optional[Cut]:
    """src's only user is src.split(size/k, dim=-1) (or a list of k sizes) or
    src.chunk(k, -1), unpacked into its k items: those items."""
    if len(src.users) != 1:
        return None
    cut = next(iter(src.users))
    k = _split_count(cut, src, size)
    if k is None:
        return None
    pieces = list(cut.users)
    if sorted(u.args[1] if u.target is operator.getitem and isinstance(u.args[1], int) else -1
              for u in pieces) != list(range(k)):
        return None
    return sorted(pieces, key=lambda u: u.args[1]), [cut]


def _split_count(cut: fx.Node, src: fx.Node, size: int) -> Optional[int]:
    """k if `cut` is src.split(size/k, dim=-1) (or a list of k sizes) or src.chunk(k, -1)."""
    name = cut.target if isinstance(cut.target, str) else getattr(cut.target, "__name__", "")
    if cut.op not in ("call_method", "call_function") or name not in ("split", "chunk") or \
            not cut.args or cut.args[0] is not src or len(cut.args) < 2:
        return None
    ndim = len(src.meta[META_TENSOR].shape)
    dim = cut.args[2] if len(cut.args) > 2 else cut.kwargs.get("dim", 0)
    if not isinstance(dim, int) or dim % ndim != ndim - 1:
        return None
    arg = cut.args[1]
    if name == "chunk":
        return arg if isinstance(arg, int) and size % arg == 0 else None
    if isinstance(arg, int):
        return size // arg if size % arg == 0 else None
    if isinstance(arg, (list, tuple)) and all(isinstance(a, int) for a in arg) and sum(arg) == size:
        return len(arg)
    return None


def _sliced_cut(src: fx.Node, size: int) -> Optional[Cut]:
    """Every user of src is `src[..., a:b]` with static bounds along the last dim (Phi-3's
    `qkv[..., :q_end]`), and the slices tile [0, size): those users, by a."""
    ndim = len(src.meta[META_TENSOR].shape)
    spans = []
    for user in src.users:
        span = _last_dim_span(user, src, ndim, size)
        if span is None:
            return None
        spans.append((span, user))
    spans.sort(key=lambda s: s[0])
    tiled = all(spans[i][0][1] == spans[i + 1][0][0] for i in range(len(spans) - 1))
    if not spans or spans[0][0][0] != 0 or spans[-1][0][1] != size or not tiled:
        return None
    return [user for _, user in spans], []


def _last_dim_span(user: fx.Node, src: fx.Node, ndim: int, size: int) -> Optional[Tuple[int, int]]:
    """(a, b) if `user` is src[..., a:b] (or src[:, ..., :, a:b] over every dim) with static
    bounds and step 1; else None."""
    if user.op != "call_function" or user.target is not operator.getitem or user.args[0] is not src:
        return None
    index = user.args[1]
    items = list(index) if isinstance(index, tuple) else [index]
    if not items or not isinstance(items[-1], slice):
        return None
    whole = [i for i in items[:-1] if i is not Ellipsis]
    if any(i != slice(None) for i in whole) or (Ellipsis not in items[:-1] and len(items) != ndim):
        return None
    last = items[-1]
    if last.step not in (None, 1) or not all(v is None or isinstance(v, int) for v in (last.start, last.stop)):
        return None
    a, b, _ = last.indices(size)
    return (a, b) if b > a else None
