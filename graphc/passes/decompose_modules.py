"""decompose_modules: rewrites calls of common torch.nn layers into functional calls.

Invariant: no call_module node targets a Linear, LayerNorm, Embedding, loss, activation,
Conv1d/2d/3d (zero padding), BatchNorm, GroupNorm, pooling or Flatten module; each became
its torch.nn.functional form reading its parameters and buffers through get_attr nodes,
so SBP rules see them as ordinary inputs. A Linear whose weight is declared split(1)
(row-parallel) becomes `linear(x, w) + b`, so its partial product takes the bias once; a
column-parallel Linear cut into equal pieces becomes one linear per piece (See NOTE:
fused pieces); a BatchNorm with batch statistics becomes sums, normalise and running
update (See NOTE: synchronised batch norm, sbp/local_ops.py); a MultiheadAttention becomes
q/k/v projections, heads, scaled_dot_product_attention and out_proj, so heads split as
Megatron's (See NOTE: MultiheadAttention by heads). Other modules stay call_module leaves.
Only stages of more than one rank are rewritten.
Requires: annotate_stages, propagate_shapes (the new nodes copy stage and shapes).
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..meta import META_AUTOCAST, META_GRAD_ENABLED, META_PIECES, META_STAGE, META_STAGE_WHY, META_TENSOR, TensorMeta
from ..placement import Broadcast, Split
from ..sbp import local_ops
from ..sbp.declared import declared_in
from ..sbp.layout import flat, mesh_shape

# elementwise modules: their functional and its keyword arguments from the module, so a
# split value stays split through them (MobileNetV2's ReLU6 gathered the batch before)
_ACTIVATIONS = {
    nn.ReLU: (F.relu, ()), nn.GELU: (F.gelu, ("approximate",)), nn.SiLU: (F.silu, ()),
    nn.Tanh: (F.tanh, ()), nn.Sigmoid: (F.sigmoid, ()), nn.ReLU6: (F.relu6, ()),
    nn.Hardswish: (F.hardswish, ()), nn.Hardsigmoid: (F.hardsigmoid, ()), nn.Mish: (F.mish, ()),
    nn.LeakyReLU: (F.leaky_relu, ("negative_slope",)), nn.ELU: (F.elu, ("alpha",)),
    nn.SELU: (F.selu, ()), nn.CELU: (F.celu, ("alpha",)), nn.Softplus: (F.softplus, ("beta", "threshold")),
    nn.Hardtanh: (F.hardtanh, ("min_val", "max_val")), nn.LogSigmoid: (F.logsigmoid, ()),
    nn.Softsign: (F.softsign, ()), nn.Tanhshrink: (F.tanhshrink, ()),
    nn.Threshold: (F.threshold, ("threshold", "value")),
}


def decompose_modules(gm: fx.GraphModule, meshes) -> fx.GraphModule:
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or len(node.args) < 1:
            continue
        if len(flat(meshes[node.meta[META_STAGE]])) == 1:
            continue  # a one-rank stage runs modules whole: nothing to lay out
        mod = gm.get_submodule(node.target)
        with gm.graph.inserting_before(node):
            mesh = meshes[node.meta[META_STAGE]]
            new = _fused_linear(gm, node, mod, mesh) or _multihead_attention(gm, node, mod, mesh) or \
                _functional(gm, node, mod)
        if new is not None:
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def _copy_meta(src: fx.Node, dst: fx.Node, tensor=None) -> fx.Node:
    dst.meta.update({k: src.meta[k] for k in (META_STAGE, META_STAGE_WHY, "nn_module_stack",
                                              "stack_trace", META_GRAD_ENABLED, META_AUTOCAST)
                     if k in src.meta})
    dst.meta[META_TENSOR] = tensor if tensor is not None else src.meta.get(META_TENSOR)
    return dst


def _attr(gm, node, name: str, t) -> fx.Node:
    return _copy_meta(node, gm.graph.get_attr(f"{node.target}.{name}"), TensorMeta.of(t))


def _call(gm, node, fn, args, kwargs=None) -> fx.Node:
    return _copy_meta(node, gm.graph.call_function(fn, tuple(args), kwargs or {}))


def _functional(gm, node: fx.Node, mod: nn.Module):
    x = node.args[0]
    if type(mod) in _ACTIVATIONS and not node.kwargs and len(node.args) == 1:
        fn, names = _ACTIVATIONS[type(mod)]
        return _call(gm, node, fn, [x], {k: getattr(mod, k) for k in names})
    if isinstance(mod, nn.Identity):
        return x
    if isinstance(mod, nn.Dropout) and len(node.args) == 1:
        return _call(gm, node, F.dropout, [x], {"p": mod.p, "training": mod.training})
    if type(mod) is nn.Linear and len(node.args) == 1:
        w = _attr(gm, node, "weight", mod.weight)
        b = _attr(gm, node, "bias", mod.bias) if mod.bias is not None else None
        layout = declared_in(gm).of(f"{node.target}.weight")
        if b is not None and layout and any(isinstance(s, Split) and s.dim == 1 for s in layout[1]):
            y = _call(gm, node, F.linear, [x, w])
            return _call(gm, node, operator.add, [y, b])
        return _call(gm, node, F.linear, [x, w] + ([b] if b is not None else []))
    if type(mod) is nn.LayerNorm and len(node.args) == 1:
        w = _attr(gm, node, "weight", mod.weight) if mod.weight is not None else None
        b = _attr(gm, node, "bias", mod.bias) if mod.bias is not None else None
        return _call(gm, node, F.layer_norm, [x, tuple(mod.normalized_shape), w, b, mod.eps])
    if type(mod) is nn.Embedding and len(node.args) == 1 and mod.max_norm is None:
        w = _attr(gm, node, "weight", mod.weight)
        return _call(gm, node, F.embedding, [x, w], {"padding_idx": mod.padding_idx})
    if type(mod) is nn.CrossEntropyLoss and len(node.args) == 2 and mod.weight is None:
        return _call(gm, node, F.cross_entropy, list(node.args),
                     {"ignore_index": mod.ignore_index, "reduction": mod.reduction,
                      "label_smoothing": mod.label_smoothing})
    if type(mod) is nn.MSELoss and len(node.args) == 2:
        return _call(gm, node, F.mse_loss, list(node.args), {"reduction": mod.reduction})
    if len(node.args) != 1 or node.kwargs:
        return None
    if type(mod) in (nn.Conv1d, nn.Conv2d, nn.Conv3d) and mod.padding_mode == "zeros":
        conv = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}[type(mod)]
        w = _attr(gm, node, "weight", mod.weight)
        b = _attr(gm, node, "bias", mod.bias) if mod.bias is not None else None
        return _call(gm, node, conv, [x, w, b, mod.stride, mod.padding, mod.dilation, mod.groups])
    if type(mod) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm):
        return _batch_norm(gm, node, mod)
    if type(mod) is nn.GroupNorm:
        w = _attr(gm, node, "weight", mod.weight) if mod.weight is not None else None
        b = _attr(gm, node, "bias", mod.bias) if mod.bias is not None else None
        return _call(gm, node, F.group_norm, [x, mod.num_groups, w, b, mod.eps])
    if type(mod) is nn.Flatten:
        return _call(gm, node, torch.flatten, [x, mod.start_dim, mod.end_dim])
    if type(mod) in _POOLS:
        fn, fields = _POOLS[type(mod)]
        return _call(gm, node, fn, [x], {k: getattr(mod, k) for k in fields})
    return None


_MAX = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
_AVG = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")
# pooling module -> (its functional form, the module fields passed as its keyword arguments)
_POOLS = {nn.MaxPool1d: (F.max_pool1d, _MAX), nn.MaxPool2d: (F.max_pool2d, _MAX),
          nn.AvgPool1d: (F.avg_pool1d, _AVG), nn.AvgPool2d: (F.avg_pool2d, _AVG + ("divisor_override",)),
          nn.AdaptiveAvgPool1d: (F.adaptive_avg_pool1d, ("output_size",)),
          nn.AdaptiveAvgPool2d: (F.adaptive_avg_pool2d, ("output_size",)),
          nn.AdaptiveMaxPool1d: (F.adaptive_max_pool1d, ("output_size", "return_indices")),
          nn.AdaptiveMaxPool2d: (F.adaptive_max_pool2d, ("output_size", "return_indices"))}


def _batch_norm(gm, node: fx.Node, mod: nn.Module) -> fx.Node:
    """nn.BatchNorm as its training-mode forward does it (See NOTE: synchronised batch norm):
    with batch statistics, sum -> statistics -> normalise -> running statistics update; with running
    statistics (eval), F.batch_norm."""
    x = node.args[0]
    w = _attr(gm, node, "weight", mod.weight) if mod.weight is not None else None
    b = _attr(gm, node, "bias", mod.bias) if mod.bias is not None else None
    buffers = [_attr(gm, node, name, getattr(mod, name)) if getattr(mod, name) is not None else None
               for name in ("running_mean", "running_var", "num_batches_tracked")]
    if not mod.training and buffers[0] is not None:
        return _call(gm, node, F.batch_norm, [x, buffers[0], buffers[1], w, b, False, 0.0, mod.eps])
    shape = x.meta[META_TENSOR].shape
    count = math.prod(shape) // shape[1]  # values per channel in the whole (micro-)batch
    dtype = x.meta[META_TENSOR].dtype
    total = _call(gm, node, local_ops.batch_norm_sum, [x])
    total.meta[META_TENSOR] = TensorMeta((shape[1],), dtype, False)
    stats = _call(gm, node, local_ops.batch_norm_stats, [x, total, count])
    stats.meta[META_TENSOR] = TensorMeta((2, shape[1]), dtype, x.meta[META_TENSOR].requires_grad)
    y = _call(gm, node, local_ops.batch_norm_apply, [x, stats, count, w, b, mod.eps])
    if mod.training and mod.track_running_stats:
        update = _call(gm, node, local_ops.batch_norm_update_, buffers + [stats, count, mod.momentum])
        update.meta[META_TENSOR] = None
    return y


# NOTE: fused pieces
# nanoGPT computes q, k, v with one Linear(C, 3C) and cuts its output:
# `q, k, v = c_attn(x).split(C, dim=2)`. Declared column-parallel (weight split(0)), a plain
# contiguous shard would give rank 0 all of q and half of k, and no rank a whole head. So,
# as Megatron stores its fused QKV weight, graphc stores such a weight (and a split bias) in
# pieces: rank r holds shard r of each of the k pieces, concatenated (META_PIECES = (k, 0) on
# its get_attr node). The Linear becomes one linear per piece on `torch.chunk(w, k, 0)`,
# whose local form is the chunk of the local shard, so every piece comes out split(-1) with
# no communication. The layout is used only when the Linear is called once, its output is
# used by nothing but that cut into equal pieces along the last dim, each divisible by the
# ranks, and no other module holds its weight. state.py shards and gathers it piece by
# piece, so full_state_dict() and the user's module see the usual layout; graph.state_dict()
# holds the pieced local component (as Megatron's checkpoints do).


def _fused_linear(gm, node: fx.Node, mod: nn.Module, mesh: tuple):
    """A column-parallel Linear whose output is only cut into equal pieces: one linear per
    piece of the weight (See NOTE: fused pieces). None when the pattern does not hold."""
    k = _pieces(gm, node, mod, mesh)
    if k is None:
        return None
    x = node.args[0]
    cut = next(iter(node.users))
    ws = _param_pieces(gm, node, "weight", mod.weight, k)
    bs = _param_pieces(gm, node, "bias", mod.bias, k) if mod.bias is not None else [None] * k
    outs = []
    for i, piece in enumerate(sorted(cut.users, key=lambda u: u.args[1])):
        outs.append(_copy_meta(node, gm.graph.call_function(
            F.linear, (x, ws[i]) + ((bs[i],) if bs[i] is not None else ())), piece.meta[META_TENSOR]))
        piece.replace_all_uses_with(outs[-1])
    for piece in list(cut.users):
        gm.graph.erase_node(piece)
    gm.graph.erase_node(cut)
    return outs[0]  # the module's node is left without users and erased by the caller


def _param_pieces(gm, node: fx.Node, name: str, t, k: int) -> list:
    p = _attr(gm, node, name, t)
    layout = declared_in(gm).of(f"{node.target}.{name}")
    if layout and any(isinstance(s, Split) for s in layout[1]):
        p.meta[META_PIECES] = (k, 0)
    chunks = _call(gm, node, torch.chunk, [p, k, 0])
    chunks.meta[META_TENSOR] = None
    piece = TensorMeta((t.shape[0] // k,) + tuple(t.shape[1:]), str(t.dtype).replace("torch.", ""),
                       t.requires_grad)
    return [_copy_meta(node, gm.graph.call_function(operator.getitem, (chunks, i)), piece)
            for i in range(k)]


def _pieces(gm, node: fx.Node, mod: nn.Module, mesh: tuple):
    """k if `node` calls a Linear with weight split(0) on one mesh axis (bias alike or whole),
    once, and its output is only cut into k equal pieces along the last dim, each divisible
    by the axis' ranks, then unpacked; else None."""
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
    n = mesh_shape(mesh)[axes[0]]
    calls = [u for u in gm.graph.nodes if u.op == "call_module" and u.target == node.target]
    holders = [q for _, q in gm.named_parameters(remove_duplicate=False) if q is mod.weight]
    if len(calls) != 1 or len(holders) != 1 or len(node.users) != 1:
        return None
    cut = next(iter(node.users))
    k = _equal_cut(cut, node, mod.out_features)
    if k is None or k < 2 or (mod.out_features // k) % n:
        return None
    pieces = list(cut.users)
    if sorted(u.args[1] if u.target is operator.getitem and isinstance(u.args[1], int) else -1
              for u in pieces) != list(range(k)):
        return None
    return k


def _equal_cut(cut: fx.Node, src: fx.Node, size: int):
    """k if `cut` is src.split(size/k, dim=-1) (or a list of k equal sizes) or src.chunk(k, -1)."""
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
    if isinstance(arg, (list, tuple)) and len(set(arg)) == 1 and sum(arg) == size:
        return len(arg)
    return None


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
# module (batch_first=False) is transposed to batch-first and back. Only calls whose
# attention weights are unused and with no key_padding_mask, attn_mask or is_causal are
# rewritten; others stay modules (a fallback on a stage of several ranks).
_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
             "average_attn_weights", "is_causal")


def _multihead_attention(gm, node: fx.Node, mod: nn.Module, mesh: tuple):
    """nn.MultiheadAttention as its functional parts, heads split when in_proj is declared
    split (See NOTE: MultiheadAttention by heads). None when the call does not qualify."""
    if type(mod) is not nn.MultiheadAttention or not mod._qkv_same_embed_dim or \
            mod.bias_k is not None or mod.add_zero_attn:
        return None
    call = dict(zip(_MHA_ARGS, node.args), **node.kwargs)
    if len(node.args) < 3 or set(call) - set(_MHA_ARGS) or \
            any(call.get(k) not in (None, False) for k in ("key_padding_mask", "attn_mask", "is_causal")):
        return None
    outs = list(node.users)
    if any(u.target is not operator.getitem or u.args[1] not in (0, 1) or (u.args[1] == 1 and u.users)
           for u in outs):
        return None
    layout = declared_in(gm).of(f"{node.target}.in_proj_weight")
    split = [a for a, s in enumerate(layout[1]) if isinstance(s, Split)] if layout else []
    if split and (len(split) > 1 or mod.num_heads % mesh_shape(mesh)[split[0]]):
        return None
    like = TensorMeta((), call["query"].meta[META_TENSOR].dtype,
                      any(call[k].meta[META_TENSOR].requires_grad for k in ("query", "key", "value")) or
                      any(p.requires_grad for p in mod.parameters()))
    once = {}  # self-attention transposes its one input once: one conversion for q, k and v
    for k in ("query", "key", "value"):
        if call[k] not in once:
            once[call[k]] = _heads_first(gm, node, mod, call[k], like)
    first = [once[call[k]] for k in ("query", "key", "value")]
    b_, l_ = first[0][1][:2]
    projected = _in_projections(gm, node, mod, first, like, packed=not split and len(once) == 1)
    heads = [_split_heads(gm, node, mod, y, (b_, l_)) for y in projected]
    p = mod.dropout if mod.training else 0.0
    o = _call(gm, node, F.scaled_dot_product_attention, heads, {"dropout_p": p})
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


def _in_projections(gm, node, mod, first: list, like: TensorMeta, packed: bool) -> list:
    """q, k, v [B, L, E]. Packed (self-attention, in_proj whole): one linear cut in three, as
    torch does, so in_proj's gradient is one parameter's (reduced with the others); else one
    linear per piece of in_proj (stored in pieces when split, See NOTE: fused pieces)."""
    bias = mod.in_proj_bias is not None
    if packed:
        t, shape = first[0]
        w = _attr(gm, node, "in_proj_weight", mod.in_proj_weight)
        args = [t, w] + ([_attr(gm, node, "in_proj_bias", mod.in_proj_bias)] if bias else [])
        qkv = _call(gm, node, F.linear, args)
        qkv.meta[META_TENSOR] = _shaped(like, shape[:2] + (3 * mod.embed_dim,))
        cut = _call(gm, node, torch.chunk, [qkv, 3, -1])
        cut.meta[META_TENSOR] = None
        return [_copy_meta(node, gm.graph.call_function(operator.getitem, (cut, i)),
                           _shaped(like, shape[:2] + (mod.embed_dim,))) for i in range(3)]
    ws = _param_pieces(gm, node, "in_proj_weight", mod.in_proj_weight, 3)
    bs = _param_pieces(gm, node, "in_proj_bias", mod.in_proj_bias, 3) if bias else [None] * 3
    out = []
    for (t, shape), w, b in zip(first, ws, bs):
        out.append(_call(gm, node, F.linear, [t, w] + ([b] if b is not None else [])))
        out[-1].meta[META_TENSOR] = _shaped(like, shape[:2] + (mod.embed_dim,))
    return out


def _method(gm, node, name: str, args, shape, like: TensorMeta) -> fx.Node:
    return _copy_meta(node, gm.graph.call_method(name, tuple(args)), _shaped(like, shape))


def _heads_first(gm, node, mod, t: fx.Node, like: TensorMeta):
    """t as [B, L, E] (a sequence-first module's [L, B, E] transposed) and that shape."""
    shape = tuple(t.meta[META_TENSOR].shape)
    if mod.batch_first:
        return t, shape
    shape = (shape[1], shape[0]) + shape[2:]
    return _method(gm, node, "transpose", [t, 0, 1], shape, like), shape


def _split_heads(gm, node, mod, y: fx.Node, bl: tuple) -> fx.Node:
    like = y.meta[META_TENSOR]
    y = _method(gm, node, "view", [y, *bl, mod.num_heads, mod.head_dim], bl + (mod.num_heads, mod.head_dim),
                like)
    return _method(gm, node, "transpose", [y, 1, 2], (bl[0], mod.num_heads, bl[1], mod.head_dim), like)


def _functional_linear(gm, node, name: str, lin: nn.Linear, x: fx.Node, shape, like: TensorMeta) -> fx.Node:
    """F.linear with the child Linear `name`'s parameters; a row-parallel one (weight declared
    split(1)) adds its bias after the partial product, once."""
    w = _attr(gm, node, f"{name}.weight", lin.weight)
    b = _attr(gm, node, f"{name}.bias", lin.bias) if lin.bias is not None else None
    layout = declared_in(gm).of(f"{node.target}.{name}.weight")
    row = layout and any(isinstance(s, Split) and s.dim == 1 for s in layout[1])
    meta = _shaped(like, shape)
    if b is not None and row:
        y = _copy_meta(node, gm.graph.call_function(F.linear, (x, w)), meta)
        return _copy_meta(node, gm.graph.call_function(operator.add, (y, b)), meta)
    return _copy_meta(node, gm.graph.call_function(F.linear, (x, w) + ((b,) if b is not None else ())), meta)
