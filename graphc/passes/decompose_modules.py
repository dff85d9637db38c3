"""decompose_modules: rewrites calls of common torch.nn layers into functional calls.

Invariant: no call_module node targets a Linear, LayerNorm, Embedding, loss, activation,
Conv1d/2d/3d (zero padding), BatchNorm, GroupNorm, pooling or Flatten module; each became
its torch.nn.functional form reading its parameters and buffers through get_attr nodes,
so SBP rules see them as ordinary inputs. A Linear whose weight is declared split(1)
(row-parallel) becomes `linear(x, w) + b`, so its partial product takes the bias once; a
column-parallel Linear cut into equal pieces becomes one linear per piece (See NOTE:
fused pieces); a BatchNorm with batch statistics becomes sum, statistics, normalise and
running update (See NOTE: synchronised batch norm, sbp/local_ops.py); a MultiheadAttention
becomes q/k/v projections, heads, scaled_dot_product_attention and out_proj, so heads split
as Megatron's (See NOTE: MultiheadAttention by heads, decompose_attention.py). Other modules
stay call_module leaves.
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

from ..meta import META_STAGE, META_TENSOR, TensorMeta
from ..placement import Broadcast, Split
from ..sbp import local_ops
from ..sbp.declared import declared_in
from ..sbp.layout import flat, mesh_shape
from .decompose_attention import multihead_attention
from .module_nodes import attr, call, copy_meta, param_pieces

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
            new = _fused_linear(gm, node, mod, mesh) or multihead_attention(gm, node, mod, mesh) or \
                _functional(gm, node, mod)
        if new is not None:
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def _functional(gm, node: fx.Node, mod: nn.Module):
    x = node.args[0]
    if type(mod) in _ACTIVATIONS and not node.kwargs and len(node.args) == 1:
        fn, names = _ACTIVATIONS[type(mod)]
        return call(gm, node, fn, [x], {k: getattr(mod, k) for k in names})
    if isinstance(mod, nn.Identity):
        return x
    if isinstance(mod, nn.Dropout) and len(node.args) == 1:
        return call(gm, node, F.dropout, [x], {"p": mod.p, "training": mod.training})
    if type(mod) is nn.Linear and len(node.args) == 1:
        w = attr(gm, node, "weight", mod.weight)
        b = attr(gm, node, "bias", mod.bias) if mod.bias is not None else None
        layout = declared_in(gm).of(f"{node.target}.weight")
        if b is not None and layout and any(isinstance(s, Split) and s.dim == 1 for s in layout[1]):
            y = call(gm, node, F.linear, [x, w])
            return call(gm, node, operator.add, [y, b])
        return call(gm, node, F.linear, [x, w] + ([b] if b is not None else []))
    if type(mod) is nn.LayerNorm and len(node.args) == 1:
        w = attr(gm, node, "weight", mod.weight) if mod.weight is not None else None
        b = attr(gm, node, "bias", mod.bias) if mod.bias is not None else None
        return call(gm, node, F.layer_norm, [x, tuple(mod.normalized_shape), w, b, mod.eps])
    if type(mod) is nn.Embedding and len(node.args) == 1 and mod.max_norm is None:
        w = attr(gm, node, "weight", mod.weight)
        return call(gm, node, F.embedding, [x, w], {"padding_idx": mod.padding_idx})
    if type(mod) is nn.CrossEntropyLoss and len(node.args) == 2 and mod.weight is None:
        return call(gm, node, F.cross_entropy, list(node.args),
                     {"ignore_index": mod.ignore_index, "reduction": mod.reduction,
                      "label_smoothing": mod.label_smoothing})
    if type(mod) is nn.MSELoss and len(node.args) == 2:
        return call(gm, node, F.mse_loss, list(node.args), {"reduction": mod.reduction})
    if len(node.args) != 1 or node.kwargs:
        return None
    if type(mod) in (nn.Conv1d, nn.Conv2d, nn.Conv3d) and mod.padding_mode == "zeros":
        conv = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}[type(mod)]
        w = attr(gm, node, "weight", mod.weight)
        b = attr(gm, node, "bias", mod.bias) if mod.bias is not None else None
        return call(gm, node, conv, [x, w, b, mod.stride, mod.padding, mod.dilation, mod.groups])
    if type(mod) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm):
        return _batch_norm(gm, node, mod)
    if type(mod) is nn.GroupNorm:
        w = attr(gm, node, "weight", mod.weight) if mod.weight is not None else None
        b = attr(gm, node, "bias", mod.bias) if mod.bias is not None else None
        return call(gm, node, F.group_norm, [x, mod.num_groups, w, b, mod.eps])
    if type(mod) is nn.Flatten:
        return call(gm, node, torch.flatten, [x, mod.start_dim, mod.end_dim])
    if type(mod) in _POOLS:
        fn, fields = _POOLS[type(mod)]
        return call(gm, node, fn, [x], {k: getattr(mod, k) for k in fields})
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
    w = attr(gm, node, "weight", mod.weight) if mod.weight is not None else None
    b = attr(gm, node, "bias", mod.bias) if mod.bias is not None else None
    buffers = [attr(gm, node, name, getattr(mod, name)) if getattr(mod, name) is not None else None
               for name in ("running_mean", "running_var", "num_batches_tracked")]
    if not mod.training and buffers[0] is not None:
        return call(gm, node, F.batch_norm, [x, buffers[0], buffers[1], w, b, False, 0.0, mod.eps])
    shape = x.meta[META_TENSOR].shape
    count = math.prod(shape) // shape[1]  # values per channel in the whole (micro-)batch
    dtype = x.meta[META_TENSOR].dtype
    total = call(gm, node, local_ops.batch_norm_sum, [x])
    total.meta[META_TENSOR] = TensorMeta((shape[1],), dtype, False)
    stats = call(gm, node, local_ops.batch_norm_stats, [x, total, count])
    stats.meta[META_TENSOR] = TensorMeta((3, shape[1]), dtype, x.meta[META_TENSOR].requires_grad)
    y = call(gm, node, local_ops.batch_norm_apply, [x, stats, count, w, b, mod.eps])
    if mod.training and mod.track_running_stats:
        update = call(gm, node, local_ops.batch_norm_update_, buffers + [stats, count, mod.momentum])
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
    ws = param_pieces(gm, node, "weight", mod.weight, k)
    bs = param_pieces(gm, node, "bias", mod.bias, k) if mod.bias is not None else [None] * k
    outs = []
    for i, piece in enumerate(sorted(cut.users, key=lambda u: u.args[1])):
        outs.append(copy_meta(node, gm.graph.call_function(
            F.linear, (x, ws[i]) + ((bs[i],) if bs[i] is not None else ())), piece.meta[META_TENSOR]))
        piece.replace_all_uses_with(outs[-1])
    for piece in list(cut.users):
        gm.graph.erase_node(piece)
    gm.graph.erase_node(cut)
    return outs[0]  # the module's node is left without users and erased by the caller


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
