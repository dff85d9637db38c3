"""decompose_modules: rewrites calls of common torch.nn layers into functional calls.

Invariant: no call_module node targets a Linear, LayerNorm, Embedding, loss, activation,
Conv1d/2d/3d (zero padding), BatchNorm, GroupNorm, pooling or Flatten module; each became
its torch.nn.functional form reading its parameters and buffers through get_attr nodes,
so SBP rules see them as ordinary inputs. A Linear whose weight is declared split(1)
(row-parallel) becomes `linear(x, w) + b`, so its partial product takes the bias once; a
column-parallel Linear cut into pieces (split, chunk or slices) becomes one linear
per piece (See NOTE: fused pieces, fused_linear.py); a BatchNorm with batch statistics becomes sum, statistics, normalise and
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
from ..placement import Split
from ..sbp import local_ops
from ..sbp.declared import declared_in
from ..sbp.layout import flat
from .decompose_attention import multihead_attention
from .fused_linear import fused_linear
from .module_nodes import attr, call

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
            new = fused_linear(gm, node, mod, mesh) or multihead_attention(gm, node, mod, mesh) or \
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
