"""Token-mean losses normalised by the whole batch (targets of feed_whole_batch).

F.cross_entropy(x, y, ignore_index=...) with reduction="mean" divides by the number of
targets that are not ignored (weighted by their class weights). Micro-batches hold
different numbers of them, so a mean per micro-batch is not eager's mean over the batch
(torchtitan #2972). Each micro-batch therefore computes its sum divided by the whole
batch's count, times the m that the runtime's 1/m loss scale takes off again:
sum over micro-batches of (1/m) * m * sum_k / count = sum / count, eager's loss.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def target_count(y: torch.Tensor, ignore_index: int = -100, weight: Optional[torch.Tensor] = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The denominator of a mean class loss: targets != ignore_index, weighted by `weight`."""
    valid = y != ignore_index
    if weight is None:
        return valid.sum().to(dtype)
    return (weight[torch.where(valid, y, 0)] * valid).sum().to(dtype)


def cross_entropy_over_batch(x, y, count: torch.Tensor, microbatches: int, **kwargs) -> torch.Tensor:
    """One micro-batch's part of cross_entropy(reduction="mean") over the whole batch."""
    kwargs["reduction"] = "sum"
    return F.cross_entropy(x, y, **kwargs) * (microbatches / count)


def nll_loss_over_batch(x, y, count: torch.Tensor, microbatches: int, **kwargs) -> torch.Tensor:
    """One micro-batch's part of nll_loss(reduction="mean") over the whole batch."""
    kwargs["reduction"] = "sum"
    return F.nll_loss(x, y, **kwargs) * (microbatches / count)
