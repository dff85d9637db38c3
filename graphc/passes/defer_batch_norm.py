"""defer_batch_norm: BatchNorm's running statistics updated once per step, from the whole mini-batch.

Invariant: with config.set_deferred_batch_norm(True), every training BatchNorm is in its
functional form (sum, statistics, normalise, update; decompose_modules leaves one-rank stages' modules
whole, so this pass rewrites those too) and its running-statistics update is
`batch_norm_deferred_update_`, which merges the micro-batches' statistics and updates once
with all of them (See NOTE: deferred batch norm, sbp/local_ops.py). Without the option
the graph is unchanged: each micro-batch updates the running statistics, as in eager
gradient accumulation.
Requires: decompose_modules.
"""
from __future__ import annotations

import torch.fx as fx
import torch.nn as nn

from ..log import warn_user
from ..sbp import local_ops
from .decompose_modules import _batch_norm

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def defer_batch_norm(gm: fx.GraphModule, enabled: bool, microbatches: int) -> fx.GraphModule:
    training = [name for name, m in gm.named_modules() if type(m) in _BATCH_NORMS and m.training]
    if training and microbatches > 1:
        warn_user(f"BatchNorm {training[0]!r}{f' (and {len(training) - 1} more)' if len(training) > 1 else ''} "
                  f"trains under gradient accumulation ({microbatches} micro-batches): each micro-batch is "
                  "normalised with its own statistics, as eager accumulation does, so the step differs "
                  "from one eager step on the whole batch (README: BatchNorm). Fix: accumulation 1 "
                  "(a larger data-parallel world instead) for whole-batch statistics; "
                  "config.set_deferred_batch_norm(True) for running statistics of the whole batch.")
    if not enabled:
        return gm
    for node in list(gm.graph.nodes):
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        if type(module) in _BATCH_NORMS:
            with gm.graph.inserting_before(node):
                new = _batch_norm(gm, node, module)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is local_ops.batch_norm_update_:
            node.target = local_ops.batch_norm_deferred_update_
            node.args = tuple(node.args) + (microbatches,)
    gm.graph.lint()
    gm.recompile()
    return gm
