"""decompose_attention: nn.MultiheadAttention as its functional parts (for decompose_modules).

See NOTE: MultiheadAttention by heads below. Requires what decompose_modules requires
(stages and shapes on the module call's node).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..meta import META_TENSOR, TensorMeta
from ..placement import Split
from ..sbp.declared import declared_in
from ..sbp.layout import mesh_shape
from .module_nodes import attr, call, copy_meta, param_pieces

# NOTE: MultiheadAttention by heads
# nn.MultiheadAttention (torchvision's ViT) keeps q, k and v in one in_proj_weight [3E, E]
# and calls F.multi_head_attention_forward, which no SBP rule sees into. Declared as Megatron
# lays attention out (in_proj_weight and in_proj_bias split(0), out_proj.weight split(1)), it
# becomes what that function computes for a module without bias_k/bias_v or zero attention:
#   q, k, v = linear(query, w_q, b_q), ...      in_proj chunked into 3 pieces (NOTE: fused
#                                              pieces): each rank holds its heads of each
#   view [B, L, H, D], transpose(1, 2)          heads split
#   o = scaled_dot_product_attention(q, k, v)   per head: no communication
#   transpose(1, 2), view [B, L, E], linear(o, out_proj.weight) + out_proj.bias
# so a layer costs Megatron's one all-reduce forward and one backward. With in_proj whole
# (data parallel) self-attention projects q, k and v with one linear cut in three, as torch
# does, so in_proj's gradient joins the bucketed gradient all-reduce. A sequence-first
# module (batch_first=False) is transposed to batch-first and back. attn_mask ([L, S] or
# [B*H, L, S]) and key_padding_mask ([B, S]), boolean or additive, become the one additive
# mask the function hands to SDPA. Only calls whose attention weights are unused and without
# is_causal are rewritten; others stay modules (a fallback on a stage of several ranks).
_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
             "average_attn_weights", "is_causal")


def multihead_attention(gm, node: fx.Node, mod: nn.Module, mesh: tuple):
    """nn.MultiheadAttention as its functional parts, heads split when in_proj is declared
    split (See NOTE: MultiheadAttention by heads). None when the call does not qualify."""
    if type(mod) is not nn.MultiheadAttention or not mod._qkv_same_embed_dim or \
            mod.bias_k is not None or mod.add_zero_attn:
        return None
    given = dict(zip(_MHA_ARGS, node.args), **node.kwargs)
    if len(node.args) < 3 or set(given) - set(_MHA_ARGS) or given.get("is_causal") or \
            any(not isinstance(given.get(k), (fx.Node, type(None))) for k in ("key_padding_mask", "attn_mask")):
        return None
    outs = list(node.users)
    if any(u.target is not operator.getitem or u.args[1] not in (0, 1) or (u.args[1] == 1 and u.users)
           for u in outs):
        return None
    layout = declared_in(gm).of(f"{node.target}.in_proj_weight")
    split = [a for a, s in enumerate(layout[1]) if isinstance(s, Split)] if layout else []
    if split and (len(split) > 1 or mod.num_heads % mesh_shape(mesh)[split[0]]):
        return None
    like = TensorMeta((), given["query"].meta[META_TENSOR].dtype,
                      any(given[k].meta[META_TENSOR].requires_grad for k in ("query", "key", "value")) or
                      any(p.requires_grad for p in mod.parameters()))
    once = {}  # self-attention transposes its one input once: one conversion for q, k and v
    for k in ("query", "key", "value"):
        if given[k] not in once:
            once[given[k]] = _heads_first(gm, node, mod, given[k])
    first = [once[given[k]] for k in ("query", "key", "value")]
    b_, l_ = first[0][1][:2]
    mask = _attention_mask(gm, node, mod, given, (b_, l_, first[1][1][1]), like)
    if mask is False:
        return None
    projected = _in_projections(gm, node, mod, first, like, packed=not split and len(once) == 1)
    heads = [_split_heads(gm, node, mod, y, f[1][:2]) for y, f in zip(projected, first)]
    p = mod.dropout if mod.training else 0.0
    o = call(gm, node, F.scaled_dot_product_attention, heads, {"attn_mask": mask, "dropout_p": p})
    o.meta[META_TENSOR] = heads[0].meta[META_TENSOR]
    o = _method(gm, node, "transpose", [o, 1, 2], (b_, l_, mod.num_heads, mod.head_dim), like)
    o = _method(gm, node, "contiguous", [o], (b_, l_, mod.num_heads, mod.head_dim), like)
    o = _method(gm, node, "view", [o, b_, l_, mod.embed_dim], (b_, l_, mod.embed_dim), like)
    out = _functional_linear(gm, node, "out_proj", mod.out_proj, o, (b_, l_, mod.embed_dim), like)
    if not mod.batch_first:
        out = _method(gm, node, "transpose", [out, 0, 1], (l_, b_, mod.embed_dim), like)
    for u in outs:
        if u.args[1] == 0:
            u.replace_all_uses_with(out)
        gm.graph.erase_node(u)
    return out  # the module's node is left without users and erased by the caller


def _shaped(like: TensorMeta, shape) -> TensorMeta:
    return TensorMeta(tuple(shape), like.dtype, like.requires_grad)


def _attention_mask(gm, node, mod, given: dict, bls: tuple, like: TensorMeta):
    """attn_mask and key_padding_mask as the one additive mask F.multi_head_attention_forward
    hands to scaled_dot_product_attention (a boolean mask: -inf where True), broadcast as
    [B or 1, H or 1, L, S]; None without masks, False for a mask of another form."""
    b_, l_, s_ = bls
    parts = []
    for name, shapes in (("attn_mask", {(l_, s_): (l_, s_), (b_ * mod.num_heads, l_, s_):
                                        (b_, mod.num_heads, l_, s_), (1, l_, s_): (1, 1, l_, s_)}),
                         ("key_padding_mask", {(b_, s_): (b_, 1, 1, s_)})):
        m = given.get(name)
        if m is None:
            continue
        meta = m.meta.get(META_TENSOR)
        if meta is None or tuple(meta.shape) not in shapes or meta.dtype not in ("bool", like.dtype):
            return False
        shape = shapes[tuple(meta.shape)]
        flat = TensorMeta(tuple(meta.shape), like.dtype, False)
        if meta.dtype == "bool":
            zeros = copy_meta(node, gm.graph.call_function(torch.zeros_like, (m,), {"dtype": getattr(torch, like.dtype)}),
                               flat)
            m = copy_meta(node, gm.graph.call_method("masked_fill", (zeros, m, float("-inf"))), flat)
        if shape != tuple(meta.shape):
            m = copy_meta(node, gm.graph.call_method("view", (m, *shape)), TensorMeta(shape, like.dtype, False))
        parts.append((m, shape))
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0][0]
    (a, sa), (b, sb) = parts
    shape = tuple(max(x, y) for x, y in zip((1,) * (4 - len(sa)) + sa, sb))
    return copy_meta(node, gm.graph.call_function(operator.add, (a, b)), TensorMeta(shape, like.dtype, False))


def _in_projections(gm, node, mod, first: list, like: TensorMeta, packed: bool) -> list:
    """q, k, v [B, L, E]. Packed (self-attention, in_proj whole): one linear cut in three, as
    torch does, so in_proj's gradient is one parameter's (reduced with the others); else one
    linear per piece of in_proj (stored in pieces when split, See NOTE: fused pieces)."""
    bias = mod.in_proj_bias is not None
    if packed:
        t, shape = first[0]
        w = attr(gm, node, "in_proj_weight", mod.in_proj_weight)
        args = [t, w] + ([attr(gm, node, "in_proj_bias", mod.in_proj_bias)] if bias else [])
        qkv = call(gm, node, F.linear, args)
        qkv.meta[META_TENSOR] = _shaped(like, shape[:2] + (3 * mod.embed_dim,))
        cut = call(gm, node, torch.chunk, [qkv, 3, -1])
        cut.meta[META_TENSOR] = None
        return [copy_meta(node, gm.graph.call_function(operator.getitem, (cut, i)),
                           _shaped(like, shape[:2] + (mod.embed_dim,))) for i in range(3)]
    ws = param_pieces(gm, node, "in_proj_weight", mod.in_proj_weight, [mod.embed_dim] * 3)
    bs = param_pieces(gm, node, "in_proj_bias", mod.in_proj_bias, [mod.embed_dim] * 3) if bias else [None] * 3
    out = []
    for (t, shape), w, b in zip(first, ws, bs):
        out.append(call(gm, node, F.linear, [t, w] + ([b] if b is not None else [])))
        out[-1].meta[META_TENSOR] = _shaped(like, shape[:2] + (mod.embed_dim,))
    return out


def _method(gm, node, name: str, args, shape, like: TensorMeta) -> fx.Node:
    return copy_meta(node, gm.graph.call_method(name, tuple(args)), _shaped(like, shape))


def _heads_first(gm, node, mod, t: fx.Node):
    """t as [B, L, E] (a sequence-first module's [L, B, E] transposed) and that shape."""
    shape = tuple(t.meta[META_TENSOR].shape)
    if mod.batch_first:
        return t, shape
    shape = (shape[1], shape[0]) + shape[2:]
    return _method(gm, node, "transpose", [t, 0, 1], shape, t.meta[META_TENSOR]), shape


def _split_heads(gm, node, mod, y: fx.Node, bl: tuple) -> fx.Node:
    like = y.meta[META_TENSOR]
    y = _method(gm, node, "view", [y, *bl, mod.num_heads, mod.head_dim], bl + (mod.num_heads, mod.head_dim),
                like)
    return _method(gm, node, "transpose", [y, 1, 2], (bl[0], mod.num_heads, bl[1], mod.head_dim), like)


def _functional_linear(gm, node, name: str, lin: nn.Linear, x: fx.Node, shape, like: TensorMeta) -> fx.Node:
    """F.linear with the child Linear `name`'s parameters; a row-parallel one (weight declared
    split(1)) adds its bias after the partial product, once."""
    w = attr(gm, node, f"{name}.weight", lin.weight)
    b = attr(gm, node, f"{name}.bias", lin.bias) if lin.bias is not None else None
    layout = declared_in(gm).of(f"{node.target}.{name}.weight")
    row = layout and any(isinstance(s, Split) and s.dim == 1 for s in layout[1])
    meta = _shaped(like, shape)
    if b is not None and row:
        y = copy_meta(node, gm.graph.call_function(F.linear, (x, w)), meta)
        return copy_meta(node, gm.graph.call_function(operator.add, (y, b)), meta)
    return copy_meta(node, gm.graph.call_function(F.linear, (x, w) + ((b,) if b is not None else ())), meta)
