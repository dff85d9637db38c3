"""The nodes a module's rewrite adds (decompose_modules, decompose_attention).

Each new node copies the module call's stage, grad mode, autocast region and stack trace,
so later passes and messages see it where the module was; a parameter is read through a
get_attr of its qualified name, and one stored in pieces is cut by torch.split (See NOTE:
fused pieces in fused_linear.py).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..meta import META_AUTOCAST, META_GRAD_ENABLED, META_PIECES, META_STAGE, META_STAGE_WHY, META_TENSOR, TensorMeta
from ..placement import Split
from ..sbp.declared import declared_in
from ..sbp.layout import Pieces


def copy_meta(src: fx.Node, dst: fx.Node, tensor=None) -> fx.Node:
    """dst with src's stage, grad mode, autocast region and stack trace, and `tensor` (or
    src's) as its value's meta."""
    dst.meta.update({k: src.meta[k] for k in (META_STAGE, META_STAGE_WHY, "nn_module_stack",
                                              "stack_trace", META_GRAD_ENABLED, META_AUTOCAST)
                     if k in src.meta})
    dst.meta[META_TENSOR] = tensor if tensor is not None else src.meta.get(META_TENSOR)
    return dst


def attr(gm, node, name: str, t) -> fx.Node:
    """A get_attr of the module's parameter or buffer `name` (t: its value)."""
    return copy_meta(node, gm.graph.get_attr(f"{node.target}.{name}"), TensorMeta.of(t))


def call(gm, node, fn, args, kwargs=None) -> fx.Node:
    """A call of fn, with the meta of the module call's node (its value's included)."""
    return copy_meta(node, gm.graph.call_function(fn, tuple(args), kwargs or {}))


def param_pieces(gm, node: fx.Node, name: str, t, sizes: list) -> list:
    """The module's parameter `name` cut into pieces of `sizes` along dim 0; declared split,
    it is stored so (META_PIECES), each rank holding its shard of every piece."""
    p = attr(gm, node, name, t)
    layout = declared_in(gm).of(f"{node.target}.{name}")
    if layout and any(isinstance(s, Split) for s in layout[1]):
        p.meta[META_PIECES] = Pieces(tuple(sizes), 0)
    cut = call(gm, node, torch.split, [p, list(sizes), 0])
    cut.meta[META_TENSOR] = None
    return [copy_meta(node, gm.graph.call_function(operator.getitem, (cut, i)),
                      TensorMeta((n,) + tuple(t.shape[1:]), str(t.dtype).replace("torch.", ""), t.requires_grad))
            for i, n in enumerate(sizes)]
