"""CheckpointedRegion: the module a stage program calls for one call of a module marked
`config.set_activation_checkpointing(True)` (passes/insert_checkpoints.py puts it there).

Eager, it runs its body under torch.utils.checkpoint (non-reentrant); compiled stages inline
the body into a compiled piece, its nodes tagged for recompute (NOTE: Compiled stages).
"""
from __future__ import annotations

import contextlib
from typing import List

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


class CheckpointedRegion(nn.Module):
    """Runs `body` (the nodes of one call of a checkpointed module) without keeping its
    activations: they are recomputed in the backward, with the buffers of the forward."""

    def __init__(self, body: fx.GraphModule, module_name: str):
        super().__init__()
        self.body = body
        self.module_name = module_name

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.body(*args)
        return checkpoint(self.body, *args, use_reentrant=False, context_fn=self._contexts)

    def _contexts(self):
        """(forward, recompute) contexts of one call, sharing its snapshot: the recompute sees
        the forward's buffers and leaves the current ones (running statistics the forward
        already updated) as they are."""
        buffers = list(self.body.buffers())
        if not buffers:
            return contextlib.nullcontext(), contextlib.nullcontext()
        snapshot: List[torch.Tensor] = []
        return _snapshot(buffers, snapshot), _as_at_forward(buffers, snapshot)


@contextlib.contextmanager
def _snapshot(buffers: List[torch.Tensor], into: List[torch.Tensor]):
    into[:] = [b.clone() for b in buffers]
    yield


@contextlib.contextmanager
def _as_at_forward(buffers: List[torch.Tensor], saved: List[torch.Tensor]):
    current = [b.clone() for b in buffers]
    with torch.no_grad():
        for b, v in zip(buffers, saved):
            b.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in zip(buffers, current):
                b.copy_(v)
