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


def global_size(x: torch.Tensor, shape: tuple, dim=None):
    """x.size() / x.shape / x.size(dim) of a split x: the global (per micro-batch) size."""
    return torch.Size(shape) if dim is None else shape[dim]


def global_numel(x: torch.Tensor, numel: int) -> int:
    """x.numel() of a split x: the global count."""
    return numel


def reshape_keeping(x: torch.Tensor, shape: tuple, kept: tuple) -> torch.Tensor:
    """view/reshape of a split x to its local `shape`, but output dim j is x's dim d for each
    (j, d) in `kept`: a dim split unevenly has another size on each rank (See NOTE: Uneven
    splits, docs/sbp.md)."""
    shape = list(shape)
    for j, d in kept:
        shape[j] = x.shape[d]
    return x.reshape(shape)


# NOTE: synchronised batch norm
# A BatchNorm in training normalises with the statistics of its whole (micro-)batch. When
# graphc lays the batch out split, the module becomes three ops (decompose_modules):
#   stats = batch_norm_stats(x, shift)            per-channel sums [3, C]: partial_sum
#   y = batch_norm_apply(x, stats, count, w, b)   reads the sums whole (broadcast)
#   batch_norm_update_(rm, rv, nbt, stats, ...)   the running statistics, from the same sums
# so SBP inference makes the sums partial_sum on a split batch and boxing all-reduces them
# once (forward); the broadcast sums read by a split op get grad_all_reduce (backward): one
# all-reduce each way, and the same numbers as eager BatchNorm on the whole batch. The sums
# are taken about `shift` (the running mean, the same on every rank), so the variance
# E[(x-k)^2] - E[x-k]^2 loses no precision once the running mean is near the batch mean.


def _channel_view(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.view((1, -1) + (1,) * (ndim - 2))


def batch_norm_stats(x: torch.Tensor, shift=None) -> torch.Tensor:
    """[sum(x - k), sum((x - k)^2), count * k] per channel of x [N, C, *] (k = shift or 0):
    every row is additive over shards of the batch or of the spatial dims."""
    c = x.shape[1]
    k = shift.detach().to(x.dtype).clone() if shift is not None else x.new_zeros(c)
    xc = x - _channel_view(k, x.dim())
    dims = [0] + list(range(2, x.dim()))
    return torch.stack([xc.sum(dims), (xc * xc).sum(dims), k * (x.numel() // c)])


def _mean_var(stats: torch.Tensor, count: int):
    centred = stats[0] / count
    return stats[2] / count + centred, stats[1] / count - centred * centred


def batch_norm_apply(x: torch.Tensor, stats: torch.Tensor, count: int, weight=None, bias=None,
                     eps: float = 1e-5) -> torch.Tensor:
    """Batch norm of x with the batch's sums (batch_norm_stats over all `count` values per
    channel): biased variance, as F.batch_norm in training."""
    mean, var = _mean_var(stats, count)
    y = (x - _channel_view(mean, x.dim())) * _channel_view(torch.rsqrt(var + eps), x.dim())
    if weight is not None:
        y = y * _channel_view(weight, x.dim())
    if bias is not None:
        y = y + _channel_view(bias, x.dim())
    return y


def batch_norm_update_(running_mean, running_var, num_batches_tracked, stats: torch.Tensor,
                       count: int, momentum) -> None:
    """The running statistics update of nn.BatchNorm in training, from the batch's sums:
    momentum (or the cumulative 1/num_batches_tracked when None), unbiased variance."""
    with torch.no_grad():
        mean, var = _mean_var(stats.detach(), count)
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
        f = 1.0 / float(num_batches_tracked) if momentum is None else momentum
        if running_mean is not None:
            running_mean.mul_(1 - f).add_(mean.to(running_mean.dtype), alpha=f)
        if running_var is not None:
            unbiased = var * (count / max(count - 1, 1))
            running_var.mul_(1 - f).add_(unbiased.to(running_var.dtype), alpha=f)


# NOTE: deferred batch norm
# With config.set_deferred_batch_norm(True) each micro-batch normalises with its own sums
# (batch_norm_apply) but does not update the running statistics; its sums are added to
# an accumulator instead, and the micro-batch that completes the step updates the running
# statistics once with the whole mini-batch's sums. The sums are additive because every
# micro-batch shifts by the same running mean (it does not move until the step's update).
def batch_norm_deferred_update_(running_mean, running_var, num_batches_tracked, stats: torch.Tensor,
                                count: int, momentum, microbatches: int) -> None:
    """Accumulates a micro-batch's sums; the last of `microbatches` applies batch_norm_update_
    with the whole mini-batch's sums (See NOTE: deferred batch norm). The running sums live
    on the buffer object itself, so they go with it."""
    key = running_mean if running_mean is not None else running_var
    with torch.no_grad():
        total, seen = getattr(key, "_graphc_deferred", (None, 0))
        total = stats.detach().clone() if total is None else total + stats.detach()
        seen += 1
        if seen < microbatches:
            key._graphc_deferred = (total, seen)
            return
        key._graphc_deferred = (None, 0)
    batch_norm_update_(running_mean, running_var, num_batches_tracked, total, count * seen, momentum)
