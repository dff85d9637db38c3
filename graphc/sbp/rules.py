"""SBP rules: for each op, the valid signatures on one mesh axis (see docs/sbp.md).

A rule gets a RuleCtx and returns candidates `(required, out)`: `required` maps input
nodes to the SBP the op needs them in (inputs not named keep their producer's SBP) and
`out` is the output's SBP. The all-broadcast signature is always valid and is added by
the chooser, so a rule lists only the sharded ones. An op without a rule (or whose rule
returns None: a case it does not cover) runs on gathered (broadcast) inputs and is marked
as a fallback.

The rules live by kind in arithmetic_rules.py, shape_rules.py and conv_rules.py (routing and
context parallel beside them); this module is their table (RULES, rule_for) and re-exports
them (`_split_candidates` and `permutation` included, which tests/sbp reads here).
"""
from __future__ import annotations

import operator
from typing import Callable, Dict, List, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..meta import META_TENSOR
from . import local_ops, routing
from .arithmetic_rules import (_split_candidates, additive, addmm, created_from, cross_entropy,
                               elementwise, embedding, filled_like, flip, layer_norm, linear,
                               linear_unary, matmul, mse_loss, multiplicative, pad, pick_along,
                               reduction, softmax)
from .context import Candidate, RuleCtx  # noqa: F401 (rules and their callers read them here)
from .conv_rules import (_pool, batch_norm_apply, batch_norm_eval, batch_norm_stats, batch_norm_sum,
                         conv, per_sample)
from .shape_rules import (attention, cast, cat, expand, index, metadata, passthrough, permutation,
                          permute, replicated, reshape, set_item, split_op, triangular)


RULES: Dict[object, Callable[[RuleCtx], List[Candidate]]] = {}


def _register(rule, *keys):
    for k in keys:
        RULES[k] = rule


_register(matmul, torch.matmul, operator.matmul, torch.mm, torch.bmm, "matmul", "mm", "bmm")
_register(linear, F.linear)
_register(addmm, torch.addmm)
_register(additive, operator.add, operator.sub, torch.add, torch.sub, "add", "sub")
_register(multiplicative, operator.mul, operator.truediv, torch.mul, torch.div, "mul", "div")
_register(linear_unary, operator.neg, torch.neg, "neg", "contiguous", "clone", "detach", torch.detach)
_register(elementwise, F.relu, torch.relu, "relu", F.gelu, F.silu, torch.tanh, "tanh",
          torch.sigmoid, "sigmoid", F.dropout, torch.exp, "exp", F.sigmoid, F.tanh)
_register(softmax, F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, "softmax",
          "log_softmax")
_register(layer_norm, F.layer_norm)
_register(embedding, F.embedding)
_register(reduction, torch.sum, torch.mean, "sum", "mean")
_register(pick_along, torch.argmax, torch.argmin, torch.amax, torch.amin, "argmax", "argmin", "amax", "amin")
_register(cross_entropy, F.cross_entropy)
_register(mse_loss, F.mse_loss)
_register(reshape, torch.reshape, torch.flatten, "view", "reshape", "flatten", torch.unflatten,
          "unflatten")
_register(permute, torch.transpose, torch.permute, "transpose", "permute", "t")
_register(cat, torch.cat)
_register(split_op, torch.split, torch.chunk, "split", "chunk")
_register(attention, F.scaled_dot_product_attention)
_register(elementwise, "masked_fill", "masked_fill_", torch.masked_fill, torch.where,
          operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
          torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge,
          "eq", "ne", "lt", "le", "gt", "ge", "logical_not", torch.logical_not, operator.invert,
          "rsqrt", torch.rsqrt, "sqrt", torch.sqrt, "pow", torch.pow, operator.pow, "abs", torch.abs,
          F.relu6, F.leaky_relu, F.elu, F.hardtanh, F.hardswish, F.softplus, F.mish,
          F.selu, F.celu, F.hardsigmoid, F.logsigmoid, F.softsign, F.tanhshrink, F.threshold)
_register(triangular, torch.tril, torch.triu, "tril", "triu")
_register(expand, "expand", torch.broadcast_to, "broadcast_to")
_register(set_item, local_ops.set_item)
_register(index, "__getitem__")   # a whole tensor indexed by a traced one: table[ids]
_register(flip, torch.flip, "flip")
_register(pad, F.pad)
_register(filled_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like)
_register(created_from, "new_zeros", "new_ones", "new_full", "new_empty")
_register(cast, "float", "double", "half", "bfloat16", "to", "type", "type_as", "long", "int", "short", "bool", "byte")
_register(metadata, "size", "dim", "numel", "nelement", "ndimension", "get_device")
_register(conv, F.conv1d, F.conv2d, F.conv3d)
_register(_pool(1, False), F.max_pool1d, F.adaptive_max_pool1d)
_register(_pool(2, False), F.max_pool2d, F.adaptive_max_pool2d)
_register(_pool(1, True), F.avg_pool1d, F.adaptive_avg_pool1d)
_register(_pool(2, True), F.avg_pool2d, F.adaptive_avg_pool2d)
_register(per_sample, F.group_norm)
_register(batch_norm_eval, F.batch_norm)
_register(batch_norm_sum, local_ops.batch_norm_sum)
_register(batch_norm_stats, local_ops.batch_norm_stats)
_register(batch_norm_apply, local_ops.batch_norm_apply)
_register(replicated, local_ops.batch_norm_update_, local_ops.batch_norm_deferred_update_)
for _rule, _targets in routing.ROUTING_OPS.items():
    _register(_rule, *_targets)
_METADATA_ATTRS = ("shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad")


def rule_for(node: fx.Node) -> Optional[Callable[[RuleCtx], List[Candidate]]]:
    if node.op == "call_function" and node.target is operator.getitem:
        src = node.args[0]
        if isinstance(src, fx.Node) and src.meta.get(META_TENSOR) is None:
            return passthrough
        return index
    if node.op == "call_function" and node.target is getattr:
        return metadata if node.args[1] in _METADATA_ATTRS else None
    if node.op in ("call_function", "call_method"):
        try:
            return RULES.get(node.target)
        except TypeError:  # unhashable target
            return None
    return None


_RANDOM = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal, torch.bernoulli,
           torch.multinomial, torch.poisson}


def draws_random(node: fx.Node) -> bool:
    """Does the op draw random numbers? Then equal results on every rank are not given."""
    return node.op == "call_function" and node.target in _RANDOM


# the table and what its callers read here (tests/sbp: the split helper and a permutation)
__all__ = ["RULES", "rule_for", "draws_random", "RuleCtx", "Candidate", "permutation", "_split_candidates"]
