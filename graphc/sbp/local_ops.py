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


def set_item(x: torch.Tensor, index, value) -> torch.Tensor:
    """`x[index] = value` out of place (See NOTE: Item writes, passes/traced_writes.py): a
    copy of x, written; trace_build records an item write in build() as this call."""
    out = x.clone()
    out[index] = value
    return out


# NOTE: synchronised batch norm
# A BatchNorm in training normalises with the statistics of its whole (micro-)batch. When
# graphc lays the batch out split, the module becomes four ops (decompose_modules):
#   total = batch_norm_sum(x)                     per-channel sum [C], detached: partial_sum
#   stats = batch_norm_stats(x, total, count)     [sum, Q, D] per channel [3, C]: partial_sum
#   y = batch_norm_apply(x, stats, count, w, b)   reads the statistics whole (broadcast)
#   batch_norm_update_(rm, rv, nbt, stats, ...)   the running statistics, from the same ones
# SBP inference makes total and stats partial_sum on a split batch, so boxing all-reduces
# each once forward; the broadcast stats read by a split op get grad_all_reduce (total is
# detached and needs none backward): two small all-reduces forward, one backward, and the
# numbers of eager BatchNorm on the whole batch.
# M2 (the sum of squares about the mean) is taken about M = total / count, the batch mean
# up to rounding: Q = sum (x - M)^2 and D = sum (x - M), both additive over shards (hence one
# all-reduce), and M2 = Q - D^2 / count. D is M's rounding error times count, so D^2 / count
# is tiny and nothing cancels: a channel whose mean is large against its spread (mean 1e4,
# std 1e-2) keeps its variance, where sums of (x - k)^2 about a shift k far from the mean
# (the running mean) lose it (4e-8 in float64 gradients). M is read detached, as its exact
# derivative in M2 is zero; D carries the part its rounding leaves: M2's gradient is
# 2 (x - M - D / count), which sums to 0 over the batch as it does exactly. Without D the
# gradient 2 (x - M) sums to 2 D, a shift common to the whole batch that a layer before on
# inputs ~ 100 multiplies by 100: float32 on data 2, gradients 3.3e-4 off with the shards' M2
# merged by Chan's formula (as before), 1.1e-5 with D, eager's own 8.5e-4
# (tests/runtime/test_deferred_batch_norm_fp32.py). torch's SyncBatchNorm all-gathers the
# shards' (mean, invstd, count) and merges them instead, which needs a result whose size is
# the number of ranks.


def _channel_view(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.view((1, -1) + (1,) * (ndim - 2))


def _channel_dims(x: torch.Tensor) -> list:
    return [0] + list(range(2, x.dim()))


def batch_norm_sum(x: torch.Tensor) -> torch.Tensor:
    """Per-channel sum [C] of x [N, C, *], detached: additive over shards of the batch or of
    the spatial dims; the total over shards / count is the batch mean."""
    return x.detach().sum(_channel_dims(x))


def batch_norm_stats(x: torch.Tensor, total: torch.Tensor, count: int) -> torch.Tensor:
    """[sum(x), sum((x - M)^2), sum(x - M)] per channel of this shard of x [N, C, *], M =
    total / count the whole batch's mean, read detached: every row is additive over shards
    (See NOTE: synchronised batch norm)."""
    dims = _channel_dims(x)
    centred = x - _channel_view(total.to(x.dtype) / count, x.dim())
    return torch.stack([x.sum(dims), centred.square().sum(dims), centred.sum(dims)])


def _mean_m2(stats: torch.Tensor, count: int):
    """The batch's mean and M2 from batch_norm_stats totalled over its `count` values."""
    return stats[0] / count, stats[1] - stats[2] * stats[2] / count


def _mean_var(stats: torch.Tensor, count: int):
    mean, m2 = _mean_m2(stats, count)
    return mean, m2 / count


def batch_norm_apply(x: torch.Tensor, stats: torch.Tensor, count: int, weight=None, bias=None,
                     eps: float = 1e-5) -> torch.Tensor:
    """Batch norm of x with the batch's statistics (batch_norm_stats totalled over all
    `count` values per channel): biased variance, as F.batch_norm in training."""
    mean, var = _mean_var(stats, count)
    y = (x - _channel_view(mean, x.dim())) * _channel_view(torch.rsqrt(var + eps), x.dim())
    if weight is not None:
        y = y * _channel_view(weight, x.dim())
    if bias is not None:
        y = y + _channel_view(bias, x.dim())
    return y


def _update_running(running_mean, running_var, num_batches_tracked, mean, m2, count: int,
                    momentum) -> None:
    if num_batches_tracked is not None:
        num_batches_tracked.add_(1)
    f = 1.0 / float(num_batches_tracked) if momentum is None else momentum
    if running_mean is not None:
        running_mean.mul_(1 - f).add_(mean.to(running_mean.dtype), alpha=f)
    if running_var is not None:
        unbiased = m2 / max(count - 1, 1)
        running_var.mul_(1 - f).add_(unbiased.to(running_var.dtype), alpha=f)


def batch_norm_update_(running_mean, running_var, num_batches_tracked, stats: torch.Tensor,
                       count: int, momentum) -> None:
    """The running statistics update of nn.BatchNorm in training, from the batch's
    statistics: momentum (or the cumulative 1/num_batches_tracked when None), unbiased
    variance."""
    with torch.no_grad():
        mean, m2 = _mean_m2(stats.detach(), count)
        _update_running(running_mean, running_var, num_batches_tracked, mean, m2, count, momentum)


# NOTE: deferred batch norm
# With config.set_deferred_batch_norm(True) each micro-batch normalises with its own
# statistics (batch_norm_apply) but does not update the running statistics; its count,
# mean and M2 are merged into an accumulator instead (Chan's pairwise formula, stable for
# micro-batches whose means differ), and the micro-batch that completes the step updates
# the running statistics once with the whole mini-batch's.
def _merge(acc, count: int, mean: torch.Tensor, m2: torch.Tensor):
    """Chan's parallel combination of (n, mean, M2) with another group's."""
    if acc is None:
        return count, mean.clone(), m2.clone()
    n, mean_a, m2_a = acc
    total = n + count
    delta = mean - mean_a
    return total, mean_a + delta * (count / total), m2_a + m2 + delta * delta * (n * count / total)


def batch_norm_deferred_update_(running_mean, running_var, num_batches_tracked, stats: torch.Tensor,
                                count: int, momentum, microbatches: int) -> None:
    """Merges a micro-batch's statistics; the last of `microbatches` updates the running
    statistics once with the whole mini-batch's (See NOTE: deferred batch norm). The
    accumulator lives on the buffer object itself, so it goes with it."""
    key = running_mean if running_mean is not None else running_var
    with torch.no_grad():
        acc, seen = getattr(key, "_graphc_deferred", (None, 0))
        acc = _merge(acc, count, *_mean_m2(stats.detach(), count))
        seen += 1
        if seen < microbatches:
            key._graphc_deferred = (acc, seen)
            return
        key._graphc_deferred = (None, 0)
        n, mean, m2 = acc
        _update_running(running_mean, running_var, num_batches_tracked, mean, m2, n, momentum)
