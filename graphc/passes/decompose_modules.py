"""decompose_modules: rewrites calls of common torch.nn layers into functional calls.

Invariant: no call_module node targets a Linear, LayerNorm, Embedding, loss or
activation module; each became its torch.nn.functional form reading its parameters
through get_attr nodes, so SBP rules see parameters as ordinary inputs. A Linear whose
weight is declared split(1) (row-parallel) becomes `linear(x, w) + b`, so its partial
product takes the bias once (see docs/sbp.md). Other modules stay call_module leaves.
Only stages of more than one rank are rewritten.
Requires: annotate_stages, propagate_shapes (the new nodes copy stage and shapes).
"""
from __future__ import annotations

import operator

import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..global_tensor import declared_layout
from ..meta import META_STAGE, META_STAGE_WHY, META_TENSOR, TensorMeta
from ..placement import Split
from ..sbp.layout import flat

_ACTIVATIONS = {nn.ReLU: F.relu, nn.GELU: F.gelu, nn.SiLU: F.silu, nn.Tanh: F.tanh,
                nn.Sigmoid: F.sigmoid}


def decompose_modules(gm: fx.GraphModule, meshes) -> fx.GraphModule:
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or len(node.args) < 1:
            continue
        if len(flat(meshes[node.meta[META_STAGE]])) == 1:
            continue  # a one-rank stage runs modules whole: nothing to lay out
        mod = gm.get_submodule(node.target)
        with gm.graph.inserting_before(node):
            new = _functional(gm, node, mod)
        if new is not None:
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return gm


def _copy_meta(src: fx.Node, dst: fx.Node, tensor=None) -> fx.Node:
    dst.meta.update({k: src.meta[k] for k in (META_STAGE, META_STAGE_WHY, "nn_module_stack",
                                              "stack_trace") if k in src.meta})
    dst.meta[META_TENSOR] = tensor if tensor is not None else src.meta.get(META_TENSOR)
    return dst


def _attr(gm, node, name: str, t) -> fx.Node:
    return _copy_meta(node, gm.graph.get_attr(f"{node.target}.{name}"), TensorMeta.of(t))


def _call(gm, node, fn, args, kwargs=None) -> fx.Node:
    return _copy_meta(node, gm.graph.call_function(fn, tuple(args), kwargs or {}))


def _functional(gm, node: fx.Node, mod: nn.Module):
    x = node.args[0]
    if type(mod) in _ACTIVATIONS and not node.kwargs and len(node.args) == 1:
        kw = {"approximate": mod.approximate} if isinstance(mod, nn.GELU) else {}
        return _call(gm, node, _ACTIVATIONS[type(mod)], [x], kw)
    if isinstance(mod, nn.Identity):
        return x
    if isinstance(mod, nn.Dropout) and len(node.args) == 1:
        return _call(gm, node, F.dropout, [x], {"p": mod.p, "training": mod.training})
    if type(mod) is nn.Linear and len(node.args) == 1:
        w = _attr(gm, node, "weight", mod.weight)
        b = _attr(gm, node, "bias", mod.bias) if mod.bias is not None else None
        layout = declared_layout(mod.weight)
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
    return None
