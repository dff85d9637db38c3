"""Local forms of ops whose result depends on global sizes (targets of localize_ops).

On a split dim the local component sees only its shard, so a mean becomes a local sum
divided by the global count: the ranks' results are then addends of the global mean
(partial_sum), exactly as eager's mean over the whole tensor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def mean_as_partial(x: torch.Tensor, dim, keepdim: bool, count: int) -> torch.Tensor:
    """mean over (a split) `dim` as this shard's addend: sum / global count."""
    if dim is None:
        return x.sum() / count
    return x.sum(dim, keepdim=keepdim) / count


def cross_entropy_partial(x, y, count: int, **kwargs) -> torch.Tensor:
    """cross_entropy(reduction='mean') of a batch shard, as its addend of the global mean."""
    kwargs["reduction"] = "sum"
    return F.cross_entropy(x, y, **kwargs) / count


def mse_loss_partial(a, b, count: int, **kwargs) -> torch.Tensor:
    """mse_loss(reduction='mean') of a shard, as its addend of the global mean."""
    kwargs["reduction"] = "sum"
    return F.mse_loss(a, b, **kwargs) / count
