"""Modules torch itself cannot run the way graphc would call them: refused with the fix.

Checked where trace_build (and propagate_shapes after it) runs a leaf module on fake
tensors, or where the tracer calls a module, so the refusal comes while tracing, on every
rank alike, with the user's line; without it torch's own error surfaced as "fails on one
micro-batch's shapes ... check the shapes", or fx's "symbolically trace a dynamo-optimized
function" with an unrelated fix.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import GraphcError
from .user_lines import caller_line


def check_runnable_module(module: nn.Module, args) -> None:
    """Raises a GraphcError for a module torch would refuse to run on these inputs."""
    if isinstance(module, nn.SyncBatchNorm):
        _check_sync_batch_norm(module, args)


def check_traceable_module(module: nn.Module, name: str, source_file: Optional[str]) -> None:
    """Raises a GraphcError for a module the tracer cannot call into: torch.compile's
    wrapper (an OptimizedModule), which fx refuses to trace."""
    # torch._dynamo is imported by torch.compile, so an OptimizedModule exists only once it is
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    if optimized is None or not isinstance(module, optimized):
        return
    inner = type(module._orig_mod).__name__
    owner, _, inside = name.partition(".")
    unwrap = (f"{owner}.{inside} = {owner}.{inside}._orig_mod, before the Graph is built" if inside
              else f"self.{name} = {name}._orig_mod in the Graph's __init__")
    raise GraphcError(
        f"module '{name}' is a torch.compile'd {inner} (an OptimizedModule), called at "
        f"{caller_line(source_file)}. graphc compiles the whole step itself: build() is traced "
        "into one static graph and planned per rank, and torch.compile's wrapper cannot be "
        "traced inside it. Fix: give the Graph the uncompiled module: drop the torch.compile(...) "
        f"call, or unwrap the compiled one with its `_orig_mod` ({unwrap}); it holds the same "
        "parameters, and state_dict names lose the '_orig_mod.' prefix.")


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
