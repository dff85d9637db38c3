"""SBP rules of arithmetic: elementwise ops, contractions (matmul, linear, addmm),
normalisations and lookups (softmax, layer_norm, embedding, pad, flip, fills), reductions
and losses. Registered in graphc/sbp/rules.py's RULES (See its docstring for what a rule
returns)."""
from __future__ import annotations

import operator
from typing import List, Tuple

import torch
import torch.fx as fx

from .context import Candidate, RuleCtx
from .layout import B, P, S


# -- elementwise ----------------------------------------------------------------------
def _split_candidates(ctx: RuleCtx) -> List[Candidate]:
    """S(d) of the output for every dim d; inputs aligned from the right, broadcast dims B."""
    out = ctx.out
    if out is None:
        return []
    r = len(out.shape)
    cands = []
    for d in range(r):
        if not ctx.splits(out.shape[d]):
            continue
        req = {}
        for t in ctx.tensors():
            shape = ctx.meta(t).shape
            td = d - (r - len(shape))
            req[t] = S(td) if td >= 0 and shape[td] == out.shape[d] else B
        cands.append((req, S(d)))
    return cands


def elementwise(ctx: RuleCtx) -> List[Candidate]:
    """Nonlinear elementwise ops: any split of the output; never partial."""
    return _split_candidates(ctx)


def additive(ctx: RuleCtx) -> List[Candidate]:
    """add/sub: splits, and P+P->P when every operand is a tensor (a scalar would be added n times)."""
    cands = _split_candidates(ctx)
    tensors = ctx.tensors()
    operands = list(ctx.node.args[:2])
    if len(tensors) == len(operands) and tensors:
        cands.append(({t: P for t in tensors}, P))
    return cands


def multiplicative(ctx: RuleCtx) -> List[Candidate]:
    """mul: one partial factor times broadcast ones stays partial; div: only the numerator."""
    cands = _split_candidates(ctx)
    tensors = ctx.tensors()
    first = ctx.node.args[0] if ctx.node.args else None
    is_div = ctx.node.target in (operator.truediv, torch.div, "div")
    for t in tensors:
        if is_div and t is not first:
            continue
        cands.append(({u: (P if u is t else B) for u in tensors}, P))
    return cands


def linear_unary(ctx: RuleCtx) -> List[Candidate]:
    """neg, contiguous, clone: splits and P->P."""
    return _split_candidates(ctx) + [({t: P for t in ctx.tensors()}, P)]


# -- contractions ---------------------------------------------------------------------
def matmul(ctx: RuleCtx) -> List[Candidate]:
    a, b = ctx.node.args[0], ctx.node.args[1]
    ma, mb, out = ctx.meta(a), ctx.meta(b), ctx.out
    if ma is None or mb is None or out is None:
        return []
    ra, rb, r = len(ma.shape), len(mb.shape), len(out.shape)
    cands: List[Candidate] = [({a: P, b: B}, P), ({a: B, b: P}, P)]
    if ra < 2 or rb < 2:
        return cands
    for d in range(r - 1):  # batch dims and rows of a
        ad, bd = d - (r - ra), d - (r - rb)
        if ad < 0 or ma.shape[ad] != out.shape[d] or not ctx.splits(out.shape[d]):
            continue
        b_req = S(bd) if d < r - 2 and bd >= 0 and mb.shape[bd] == out.shape[d] else B
        cands.append(({a: S(ad), b: b_req}, S(d)))
    if ctx.splits(out.shape[-1]):
        cands.append(({a: B, b: S(rb - 1)}, S(r - 1)))
    if ctx.splits(ma.shape[-1]):
        cands.append(({a: S(ra - 1), b: S(rb - 2)}, P))
    return cands


def linear(ctx: RuleCtx) -> List[Candidate]:
    """F.linear(x, w, b): w is [out, in]. Row-parallel (w split(1)) is partial, so it takes no bias."""
    x, w = ctx.node.args[0], ctx.node.args[1]
    bias = ctx.arg(2, "bias")
    mx, mw, out = ctx.meta(x), ctx.meta(w), ctx.out
    if mx is None or mw is None or out is None:
        return []
    r = len(out.shape)
    with_bias = ctx.meta(bias) is not None
    cands: List[Candidate] = []
    for d in range(r - 1):
        if ctx.splits(out.shape[d]):
            req = {x: S(d), w: B}
            if with_bias:
                req[bias] = B
            cands.append((req, S(d)))
    if ctx.splits(out.shape[-1]):
        req = {x: B, w: S(0)}
        if with_bias:
            req[bias] = S(0)
        cands.append((req, S(r - 1)))
    if not with_bias:
        cands.append(({x: P, w: B}, P))
        if ctx.splits(mx.shape[-1]):
            cands.append(({x: S(len(mx.shape) - 1), w: S(1)}, P))
    return cands


def addmm(ctx: RuleCtx) -> List[Candidate]:
    bias, a, b = ctx.node.args[:3]
    mbias, out = ctx.meta(bias), ctx.out
    if mbias is None or out is None:
        return []
    cands = []
    if ctx.splits(out.shape[0]):
        rows = S(0) if len(mbias.shape) == 2 and mbias.shape[0] == out.shape[0] else B
        cands.append(({bias: rows, a: S(0), b: B}, S(0)))
    if ctx.splits(out.shape[1]):
        cols = S(len(mbias.shape) - 1) if mbias.shape[-1] == out.shape[1] else B
        cands.append(({bias: cols, a: B, b: S(1)}, S(1)))
    return cands


# -- normalisations and lookups --------------------------------------------------------
def _dim(ctx: RuleCtx, i: int, name: str, ndim: int) -> int:
    d = ctx.arg(i, name)
    return d % ndim if isinstance(d, int) else d


def softmax(ctx: RuleCtx) -> List[Candidate]:
    x = ctx.node.args[0]
    nd = len(ctx.meta(x).shape)
    dim = _dim(ctx, 1, "dim", nd)
    return [c for c in _split_candidates(ctx) if c[1].dim != dim]


def flip(ctx: RuleCtx) -> List[Candidate]:
    """flip(x, dims): a split dim that is not flipped stays split (each shard reverses its
    own entries along the others); linear, so P -> P."""
    x = ctx.node.args[0]
    nd = len(ctx.meta(x).shape)
    dims = ctx.arg(1, "dims")
    flipped = {d % nd for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    return [({x: P}, P)] + [c for c in _split_candidates(ctx) if c[1].dim not in flipped]


def pad(ctx: RuleCtx) -> List[Candidate]:
    """F.pad(x, pad, mode, value): the last len(pad)//2 dims grow; any other split dim stays
    split (each shard pads its own rows alike: HF's causal-LM loss pads its labels' last
    dim). Constant zero padding is linear, so P -> P."""
    x, mx = ctx.node.args[0], ctx.meta(ctx.node.args[0])
    widths = ctx.arg(1, "pad")
    if mx is None or not isinstance(widths, (list, tuple)):
        return []
    nd = len(mx.shape)
    grown = {nd - 1 - i for i in range(len(widths) // 2)}
    cands = [c for c in _split_candidates(ctx) if c[1].dim not in grown]
    if ctx.arg(2, "mode", "constant") == "constant" and not ctx.arg(3, "value", None):
        cands.append(({x: P}, P))
    return cands


def filled_like(ctx: RuleCtx) -> List[Candidate]:
    """zeros_like/ones_like/full_like/empty_like(x): x's layout with its values replaced, so a
    split x gives the local shard's shape, split alike (never partial: ones would add up)."""
    return _split_candidates(ctx)


def created_from(ctx: RuleCtx) -> List[Candidate]:
    """x.new_zeros(shape) / new_ones / new_full / new_empty: a new tensor of the shape given,
    whole on every rank; x gives only its dtype and device, so it may be laid out any way
    (gathering it first was a fallback: T5's `_shift_right` on a split batch)."""
    x = ctx.node.args[0]
    if not isinstance(x, fx.Node) or ctx.meta(x) is None:
        return []
    layouts = [B, P] + [S(d) for d, size in enumerate(ctx.meta(x).shape) if ctx.splits(size)]
    return [({x: layout}, B) for layout in layouts]


def layer_norm(ctx: RuleCtx) -> List[Candidate]:
    x = ctx.node.args[0]
    shape = ctx.arg(1, "normalized_shape")
    nd = len(ctx.meta(x).shape)
    keep = nd - len(shape if isinstance(shape, (list, tuple)) else [shape])
    cands = []
    for d in range(keep):
        if ctx.splits(ctx.meta(x).shape[d]):
            cands.append(({t: (S(d) if t is x else B) for t in ctx.tensors()}, S(d)))
    return cands


def embedding(ctx: RuleCtx) -> List[Candidate]:
    """Split indices; column-split table (S(1)); vocabulary-split table (S(0) -> partial)."""
    idx, w = ctx.node.args[0], ctx.node.args[1]
    mi, mw, out = ctx.meta(idx), ctx.meta(w), ctx.out
    cands: List[Candidate] = []
    for d in range(len(mi.shape)):
        if ctx.splits(mi.shape[d]):
            cands.append(({idx: S(d), w: B}, S(d)))
    if ctx.splits(mw.shape[1]):
        cands.append(({idx: B, w: S(1)}, S(len(out.shape) - 1)))
    if ctx.splits(mw.shape[0]):
        cands.append(({idx: B, w: S(0)}, P))
    return cands


# -- reductions and losses -------------------------------------------------------------
def reduce_dims(ctx: RuleCtx) -> Tuple[List[int], bool]:
    x = ctx.node.args[0]
    nd = len(ctx.meta(x).shape)
    dim = ctx.arg(1, "dim")
    keepdim = bool(ctx.arg(2, "keepdim", False))
    if dim is None:
        return list(range(nd)), keepdim
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return sorted(d % nd for d in dims), keepdim


def reduction(ctx: RuleCtx) -> List[Candidate]:
    """sum/mean: a split reduced dim gives partial_sum (mean divides by the global size)."""
    x = ctx.node.args[0]
    mx = ctx.meta(x)
    dims, keepdim = reduce_dims(ctx)
    cands: List[Candidate] = [({x: P}, P)]
    for d in range(len(mx.shape)):
        if not ctx.splits(mx.shape[d]):
            continue
        if d in dims:
            cands.append(({x: S(d)}, P))
        else:
            cands.append(({x: S(d)}, S(d if keepdim else d - sum(1 for r in dims if r < d))))
    return cands


def pick_along(ctx: RuleCtx) -> List[Candidate]:
    """argmax/argmin/amax/amin over `dim`: a split dim that is not reduced stays split (each
    shard's rows pick their own entry, the one the whole tensor's rows pick: predictions of a
    batch split over data ranks). Over a split dim there is no partial form (a max of the
    shards is not their sum), nor over every dim at once (argmax's flat index)."""
    x = ctx.node.args[0]
    mx = ctx.meta(x)
    if mx is None or ctx.arg(1, "dim") is None:
        return []
    dims, keepdim = reduce_dims(ctx)
    return [({x: S(d)}, S(d if keepdim else d - sum(1 for r in dims if r < d)))
            for d in range(len(mx.shape)) if d not in dims and ctx.splits(mx.shape[d])]


def cross_entropy(ctx: RuleCtx) -> List[Candidate]:
    """Batch-split logits and targets: per-sample losses split, mean/sum partial."""
    x, y = ctx.node.args[0], ctx.node.args[1]
    if ctx.node.kwargs.get("weight") is not None or ctx.arg(2, "weight") is not None:
        return []
    if not ctx.splits(ctx.meta(x).shape[0]):
        return []
    red = ctx.node.kwargs.get("reduction", "mean")
    return [({x: S(0), y: S(0)}, S(0) if red == "none" else P)]


def mse_loss(ctx: RuleCtx) -> List[Candidate]:
    a, b = ctx.node.args[0], ctx.node.args[1]
    red = ctx.arg(3, "reduction", "mean")
    if ctx.meta(a).shape != ctx.meta(b).shape:
        return []
    return [({a: S(d), b: S(d)}, S(d) if red == "none" else P)
            for d, size in enumerate(ctx.meta(a).shape) if ctx.splits(size)]
