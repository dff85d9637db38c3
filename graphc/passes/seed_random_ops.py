"""seed_random_ops: every random op draws what its layout needs, not what its rank's RNG holds.

Invariant: each op that draws random numbers (F.dropout and its kin, nn.Dropout,
scaled_dot_product_attention with dropout_p > 0, torch.rand/randn/randint/bernoulli/...,
Tensor.bernoulli_/uniform_/normal_/...) is a call of `ops.random_ops.seeded`, which draws from
a generator seeded by (base seed, step, micro-batch, node name, this rank's coordinates
along the mesh axes where the node's output is split). On broadcast (and partial_sum) axes
every replica draws the same numbers, so replicas stay equal; each shard of a split value
draws its own. See NOTE: Replica-equal randomness in ops/random_ops.py. An op placed on one
rank (no replicas, no shards) keeps drawing from that rank's own RNG, as eager does.
Requires: infer_sbp and insert_boxing (node.meta[META_SBP] is each node's final layout).
"""
from __future__ import annotations

import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..meta import META_SBP
from ..placement import Split
from ..ops.random_ops import RANDOM_FUNCTIONS, RANDOM_METHODS, seeded
from ..sbp.layout import coord, flat

_NAME_OF = {fn: name for name, fn in RANDOM_FUNCTIONS.items()}
_MODULES = {nn.Dropout: "dropout", nn.Dropout1d: "dropout1d", nn.Dropout2d: "dropout2d",
            nn.Dropout3d: "dropout3d", nn.AlphaDropout: "alpha_dropout",
            nn.FeatureAlphaDropout: "feature_alpha_dropout"}


def seed_random_ops(gm: fx.GraphModule) -> fx.GraphModule:
    for node in list(gm.graph.nodes):
        op = _random_op(gm, node)
        sig = node.meta.get(META_SBP)
        if op is None or sig is None or len(flat(sig.mesh)) == 1:
            continue
        args, kwargs = node.args, dict(node.kwargs)
        if node.op == "call_module":
            mod = gm.get_submodule(node.target)
            kwargs = {"p": mod.p, "training": mod.training, "inplace": mod.inplace}
        node.op, node.target = "call_function", seeded
        node.args = (op, node.name, _shard_coords(sig)) + tuple(args)
        node.kwargs = kwargs
    gm.graph.lint()
    gm.recompile()
    return gm


def _random_op(gm: fx.GraphModule, node: fx.Node):
    """The RANDOM_FUNCTIONS name (or "Tensor.<method>") of a node that draws, else None."""
    if node.op == "call_function":
        name = _NAME_OF.get(node.target) if _hashable(node.target) else None
        if name == "scaled_dot_product_attention" and not _attention_drops(node):
            return None
        return name
    if node.op == "call_method" and node.target in RANDOM_METHODS:
        return "Tensor." + node.target
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if type(mod) in _MODULES and len(node.args) == 1 and not node.kwargs:
            return _MODULES[type(mod)]
    return None


def _attention_drops(node: fx.Node) -> bool:
    p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
    return isinstance(p, fx.Node) or p != 0.0


def _shard_coords(sig) -> tuple:
    """(rank, coordinate along the split axes) per rank of the node's mesh; () when the
    output is split on no axis (every rank holds a replica or a partial sum)."""
    axes = [a for a, s in enumerate(sig.out) if isinstance(s, Split)]
    if not axes:
        return ()
    return tuple((r, tuple(coord(sig.mesh, r)[a] for a in axes)) for r in flat(sig.mesh))


def _hashable(target) -> bool:
    try:
        hash(target)
    except TypeError:
        return False
    return True
