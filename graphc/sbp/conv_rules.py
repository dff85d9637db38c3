"""SBP rules of convolution, pooling and (batch, group) normalisation. Registered in
graphc/sbp/rules.py's RULES."""
from __future__ import annotations

from typing import List


from .context import Candidate, RuleCtx
from .layout import B, P, S, chunk_sizes
from .arithmetic_rules import _split_candidates


# -- convolution, pooling, normalisation ------------------------------------------------
def conv(ctx: RuleCtx) -> List[Candidate]:
    """conv1d/2d(x, w, b, stride, padding, dilation, groups), x [N, Cin, *]: split the batch;
    with groups=1 also output channels (w, b split(0)) and, without bias, input channels
    (w split(1)) -> P. Spatial dims are never split (a window crosses shard edges)."""
    x, w, bias = ctx.node.args[0], ctx.arg(1, "weight"), ctx.arg(2, "bias")
    mx, mw, out = ctx.meta(x), ctx.meta(w), ctx.out
    if mx is None or mw is None or out is None:
        return []
    groups = ctx.arg(6, "groups", 1)
    c = 1 if len(mx.shape) == len(mw.shape) else 0  # unbatched input: [Cin, *]
    has_bias = ctx.meta(bias) is not None
    cands: List[Candidate] = []

    def with_bias(req, sb):
        return {**req, bias: sb} if has_bias else req
    if c == 1 and ctx.splits(out.shape[0]):
        cands.append((with_bias({x: S(0), w: B}, B), S(0)))
    if groups == 1 and ctx.splits(out.shape[c]):
        cands.append((with_bias({x: B, w: S(0)}, S(0)), S(c)))
    if groups == 1 and not has_bias and fills(ctx, mx.shape[c]):
        cands.append(({x: S(c), w: S(1)}, P))
    return cands


def fills(ctx: RuleCtx, size: int) -> bool:
    """A split of a dim of `size` with a non-empty shard on every rank: torch.chunk's cut
    leaves the last ranks nothing when n > 2 (4 over 3: 2, 2, 0), which ops over channels
    refuse (pooling, batch norm) or get wrong (a conv summing 0 input channels gives 0
    output channels). Found by tests/sbp/test_rule_table.py (See NOTE: SBP rule check)."""
    return ctx.splits(size) and min(chunk_sizes(size, ctx.n)) > 0


def _pool(spatial: int, linear: bool):
    def pool(ctx: RuleCtx) -> List[Candidate]:
        """Pooling windows stay inside (sample, channel): split those dims; averages are
        linear, so P->P too."""
        x, out = ctx.node.args[0], ctx.out
        if out is None:  # return_indices: a tuple
            return []
        keep = len(out.shape) - spatial   # the channel dim is keep - 1: no empty shard
        cands = [c for c in _split_candidates(ctx) if c[1].dim < keep - 1
                 or (c[1].dim == keep - 1 and fills(ctx, out.shape[keep - 1]))]
        return cands + ([({x: P}, P)] if linear else [])
    return pool


def per_sample(ctx: RuleCtx) -> List[Candidate]:
    """group_norm(x, groups, w, b): statistics per sample, so split the batch only."""
    x, out = ctx.node.args[0], ctx.out
    if out is None or len(out.shape) < 2 or not ctx.splits(out.shape[0]):
        return []
    return [({t: (S(0) if t is x else B) for t in ctx.tensors()}, S(0))]


def _channel_split(ctx: RuleCtx, x, per_channel, out_dim_ok) -> List[Candidate]:
    """Candidates for an op on x [N, C, *] with per-channel tensors [C]: any dim d
    accepted by out_dim_ok with per-channel tensors B; the channel dim with them S(0)."""
    mx = ctx.meta(x)
    cands: List[Candidate] = []
    for d, size in enumerate(mx.shape):
        if not ctx.splits(size):
            continue
        if d == 1:
            if fills(ctx, size):
                cands.append(({x: S(1), **{t: S(0) for t in per_channel}}, S(1)))
        elif out_dim_ok(d):
            cands.append(({x: S(d), **{t: B for t in per_channel}}, S(d)))
    return cands


def batch_norm_eval(ctx: RuleCtx) -> List[Candidate]:
    """F.batch_norm with running statistics (training=False) is per-channel affine: split
    anything. With batch statistics (training=True) called directly it has no rule (the
    modules are rewritten to batch_norm_stats/apply by decompose_modules instead)."""
    if ctx.arg(5, "training", False):
        return None
    x = ctx.node.args[0]
    per_channel = [t for t in ctx.tensors() if t is not x]
    return _channel_split(ctx, x, per_channel, lambda d: True)


def batch_norm_sum(ctx: RuleCtx) -> List[Candidate]:
    """Per-channel sums [C] of x [N, C, *]: over a split batch or spatial dim partial sums
    (P), on split channels split. See NOTE: synchronised batch norm."""
    cands: List[Candidate] = []
    for d, size in enumerate(ctx.meta(ctx.node.args[0]).shape):
        if ctx.splits(size):
            cands.append(({ctx.node.args[0]: S(d)}, S(0) if d == 1 else P))
    return cands


def batch_norm_stats(ctx: RuleCtx) -> List[Candidate]:
    """Per-channel statistics [3, C] of x [N, C, *] about the batch mean (from the sums,
    whole): over a split batch or spatial dim partial sums (P), on split channels split.
    See NOTE: synchronised batch norm."""
    x, total = ctx.node.args[0], ctx.arg(1, "total")
    cands: List[Candidate] = []
    for d, size in enumerate(ctx.meta(x).shape):
        if ctx.splits(size):
            cands.append(({x: S(d), total: S(0) if d == 1 else B}, S(1) if d == 1 else P))
    return cands


def batch_norm_apply(ctx: RuleCtx) -> List[Candidate]:
    """Normalise x with the (global) sums: x split anywhere, the sums whole (B); or x on
    split channels with the sums and affine parameters split alike."""
    x = ctx.node.args[0]
    per_channel = [t for t in ctx.tensors() if t is not x]
    stats = ctx.node.args[1]
    cands = _channel_split(ctx, x, per_channel, lambda d: True)
    for req, _ in cands:  # the statistics [3, C] split along their dim 1, not 0
        if isinstance(req.get(stats), S):
            req[stats] = S(1)
    return cands
