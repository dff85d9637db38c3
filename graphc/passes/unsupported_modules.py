"""Modules torch itself cannot run the way graphc would call them: refused with the fix.

Checked where trace_build (and propagate_shapes after it) runs a leaf module on fake
tensors, so the refusal comes while tracing, on every rank alike, with the user's line;
without it torch's own error surfaced as "fails on one micro-batch's shapes ... check the
shapes".
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import GraphcError
from .user_lines import caller_line


def check_runnable_module(module: nn.Module, args) -> None:
    """Raises a GraphcError for a module torch would refuse to run on these inputs."""
    if isinstance(module, nn.SyncBatchNorm):
        _check_sync_batch_norm(module, args)


def _check_sync_batch_norm(module: nn.SyncBatchNorm, args) -> None:
    # torch's own condition (SyncBatchNorm.forward): it syncs in training under a process
    # group, and only on an accelerator
    x = args[0] if args else None
    if not (module.training and dist.is_available() and dist.is_initialized()
            and isinstance(x, torch.Tensor) and x.device.type == "cpu"):
        return
    raise GraphcError(
        f"a torch.nn.SyncBatchNorm({module.num_features}) runs on a cpu placement at "
        f"{caller_line(None)}: torch's SyncBatchNorm needs CUDA (or XPU) tensors once a process "
        "group exists ('SyncBatchNorm expected input tensor to be on GPU'). graphc needs no "
        "SyncBatchNorm: under data parallel it normalises a split batch with the statistics of "
        "the whole batch itself (one all-reduce of per-channel sums), so a plain BatchNorm is "
        "sync-BN here, and self.config.set_deferred_batch_norm(True) also makes its running "
        "statistics those of the whole mini-batch, updated once per step. Fix: build the model "
        "with nn.BatchNorm1d/2d/3d (drop nn.SyncBatchNorm.convert_sync_batchnorm(model)), or "
        "convert it back: replace each SyncBatchNorm by a BatchNorm of the same num_features, "
        "eps, momentum and affine, copying its state_dict().")
