"""SBP rules for routing and indexing ops: what a mixture-of-experts router and its
dispatch do to each token (transformers' batched_mm experts, Mixtral, Qwen3-MoE).

NOTE: Routing keeps the batch split
A router picks experts per token: `topk` of each token's scores over the experts dim,
`repeat_interleave` of each token once per chosen expert, the chosen experts' weights
looked up by the tokens' expert ids (`w[ids]`), one `bmm` per (token, expert) pair, the
pairs summed back into their token. Every step reads one token's row (or its k pairs'
rows, adjacent) and nothing of another token's, so a batch split over data ranks stays
split through all of it: each rank routes its own tokens. Without these rules the first
router gathered the batch, and every later layer ran whole on every rank (issue 32). The
expert weights are read whole (B) by split ids, so their gradient is partial over the
data ranks and synchronised after backward like any data-parallel weight.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.fx as fx

from .experts import moe_experts
from .context import Candidate, RuleCtx
from .layout import B, P, S, chunk_sizes


def _ndim(ctx: RuleCtx, a) -> Optional[int]:
    meta = ctx.meta(a)
    return None if meta is None else len(meta.shape)


def _kept_splits(ctx: RuleCtx, x, dims_out) -> List[Candidate]:
    """x S(d) -> S(dims_out[d]) for every dim d of x that has a place in the output."""
    shape = ctx.meta(x).shape
    return [({x: S(d)}, S(j)) for d, j in enumerate(dims_out) if j is not None and ctx.splits(shape[d])]


def along(ctx: RuleCtx) -> List[Candidate]:
    """topk/sort/argsort/cumsum/cumprod along `dim` (default -1; the output keeps the input's
    rank): every other dim is independent rows, so a split there stays split (topk's values
    and indices alike, as the tuple's items: see passthrough). No partial form (which
    entries win depends on the whole value)."""
    x = ctx.node.args[0]
    nd = _ndim(ctx, x)
    if nd is None:
        return []
    default = 0 if _name(ctx.node) in ("cumsum", "cumprod") else -1
    dim = ctx.arg(2 if _name(ctx.node) == "topk" else 1, "dim", default)
    if not isinstance(dim, int):
        return None
    dim %= max(nd, 1)
    return _kept_splits(ctx, x, [None if d == dim else d for d in range(nd)])


def repeat_interleave(ctx: RuleCtx) -> List[Candidate]:
    """x.repeat_interleave(k, dim) with an int k: each entry k times in a row along dim. A
    split of another dim stays; a split of dim itself too when its shards are equal (rank
    r's rows repeated are rows r*n*k/ranks.. of the whole result: torch.chunk's shard only
    for equal shards). Linear: P -> P. Repeats given as a tensor (counts from data) or no
    dim (flattened) have no rule."""
    x, k, dim = ctx.node.args[0], ctx.arg(1, "repeats"), ctx.arg(2, "dim")
    nd = _ndim(ctx, x)
    if nd is None or not isinstance(k, int) or not isinstance(dim, int):
        return None
    dim %= nd
    shape = ctx.meta(x).shape
    cands: List[Candidate] = [({x: P}, P)]
    for d in range(nd):
        if ctx.splits(shape[d]) and (d != dim or ctx.divisible(shape[d])):
            cands.append(({x: S(d)}, S(d)))
    return cands


def unsqueeze(ctx: RuleCtx) -> List[Candidate]:
    """x.unsqueeze(dim): a new dim of 1; every split moves past it. Linear: P -> P."""
    x = ctx.node.args[0]
    nd = _ndim(ctx, x)
    dim = ctx.arg(1, "dim")
    if nd is None or not isinstance(dim, int):
        return None
    at = dim % (nd + 1)
    return [({x: P}, P)] + _kept_splits(ctx, x, [d if d < at else d + 1 for d in range(nd)])


def squeeze(ctx: RuleCtx) -> List[Candidate]:
    """x.squeeze(dim) / x.squeeze(): dims of 1 go (never split); the others keep their
    splits, renumbered. A dim the squeeze names (every dim without one) stays split only
    where no rank's shard has 1 entry, which its local squeeze would take away. Linear:
    P -> P."""
    x = ctx.node.args[0]
    shape = ctx.meta(x).shape if ctx.meta(x) is not None else None
    dim = ctx.arg(1, "dim")
    if shape is None:
        return []
    nd = len(shape)
    named = range(nd) if dim is None else [d % nd for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
    gone = {d for d in named if shape[d] == 1}
    dims_out, j = [], 0
    for d in range(nd):
        shard_of_one = d in named and 1 in chunk_sizes(shape[d], ctx.n)
        dims_out.append(None if d in gone or shard_of_one else j)
        j += d not in gone
    return [({x: P}, P)] + _kept_splits(ctx, x, dims_out)


def one_hot(ctx: RuleCtx) -> List[Candidate]:
    """F.one_hot(ids, num_classes): a new last dim of classes; every split of ids stays."""
    ids = ctx.node.args[0]
    nd = _ndim(ctx, ids)
    if nd is None or not isinstance(ctx.arg(1, "num_classes", -1), int) or ctx.arg(1, "num_classes", -1) < 0:
        return None   # the class count read from the data (max + 1) differs per shard
    return _kept_splits(ctx, ids, list(range(nd)))


def gather(ctx: RuleCtx) -> List[Candidate]:
    """torch.gather(x, dim, index): out[i][j] = x[i][index[i][j]] along dim; every other dim
    pairs x's row with index's row, so both split alike there (equal sizes). Linear in x."""
    x, dim, index = ctx.node.args[0], ctx.arg(1, "dim"), ctx.arg(2, "index")
    mx, mi = ctx.meta(x), ctx.meta(index)
    if mx is None or mi is None or not isinstance(dim, int):
        return None
    dim %= len(mx.shape)
    cands: List[Candidate] = [({x: P, index: B}, P)]
    for d, size in enumerate(mi.shape):
        if d != dim and size == mx.shape[d] and ctx.splits(size):
            cands.append(({x: S(d), index: S(d)}, S(d)))
    return cands


def index_add(ctx: RuleCtx) -> List[Candidate]:
    """x.index_add(dim, index, source): source's slice i added into x's slice index[i] along
    dim. Along any other dim x and source line up entry by entry, so they split alike there
    (the index whole). Linear in (x, source) together: P + P -> P."""
    x, dim, index, source = ctx.node.args[0], ctx.arg(1, "dim"), ctx.arg(2, "index"), ctx.arg(3, "source")
    mx, ms = ctx.meta(x), ctx.meta(source)
    if mx is None or ms is None or not isinstance(dim, int) or ctx.node.kwargs.get("alpha", 1) != 1:
        return None
    dim %= len(mx.shape)
    cands: List[Candidate] = [({x: P, index: B, source: P}, P)]
    for d, size in enumerate(mx.shape):
        if d != dim and ms.shape[d] == size and ctx.splits(size):
            cands.append(({x: S(d), index: B, source: S(d)}, S(d)))
    return cands


def experts(ctx: RuleCtx) -> List[Candidate]:
    """moe_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj): each token's
    row from its own k pairs, so tokens split alike keep the split with the experts whole;
    with the stacked weights split over the experts (declared: their producer is S(0)), the
    expert-parallel form, whose local form exchanges the tokens (See NOTE: Expert parallel,
    graphc/ops/experts.py). No partial form: the experts' MLP is not linear."""
    hidden, index, weights, gate_up, down = ctx.node.args[:5]
    mh, mg = ctx.meta(hidden), ctx.meta(gate_up)
    if mh is None or mg is None:
        return None
    cands: List[Candidate] = []
    tokens = {hidden: S(0), index: S(0), weights: S(0)}
    if all(ctx.prod.get(p) == S(0) for p in (gate_up, down)) and ctx.divisible(mg.shape[0]):
        cands.append(({**tokens, gate_up: S(0), down: S(0)}, S(0)))
    if ctx.splits(mh.shape[0]):
        cands.append(({**tokens, gate_up: B, down: B}, S(0)))
    return cands


def histc(ctx: RuleCtx) -> List[Candidate]:
    """torch.histc(x, bins, min, max) with fixed bounds counts every entry (the aux loss of a
    router counts its tokens' experts): each rank's counts of its shard are addends, S(d) -> P.
    Bounds from the data (min == max) differ per shard: no split form."""
    x = ctx.node.args[0]
    low, high = ctx.arg(2, "min", 0), ctx.arg(3, "max", 0)
    if ctx.meta(x) is None or not isinstance(low, (int, float)) or low == high:
        return None
    return [({x: S(d)}, P) for d, size in enumerate(ctx.meta(x).shape) if ctx.splits(size)]


def index_by_tensor(ctx: RuleCtx, x: fx.Node, index: fx.Node) -> List[Candidate]:
    """x[ids] with one integer tensor (the experts' weights looked up by the tokens' expert
    ids): out[i..., :] = x[ids[i...], :]. Split ids give split rows (x whole); x split
    along a later dim keeps it, after ids' dims; linear in x: P -> P with ids whole."""
    mx, mi = ctx.meta(x), ctx.meta(index)
    if mx is None or mi is None or mi.dtype not in ("int64", "int32", "int16", "int8", "uint8"):
        return None
    k = len(mi.shape)
    cands: List[Candidate] = [({x: P, index: B}, P)]
    cands += [({x: B, index: S(d)}, S(d)) for d, size in enumerate(mi.shape) if ctx.splits(size)]
    cands += [({x: S(d), index: B}, S(k + d - 1)) for d in range(1, len(mx.shape)) if ctx.splits(mx.shape[d])]
    return cands


def _name(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


ROUTING_OPS = {
    along: (torch.topk, "topk", torch.sort, "sort", torch.argsort, "argsort",
            torch.cumsum, "cumsum", torch.cumprod, "cumprod"),
    repeat_interleave: (torch.repeat_interleave, "repeat_interleave"),
    unsqueeze: (torch.unsqueeze, "unsqueeze"),
    squeeze: (torch.squeeze, "squeeze"),
    one_hot: (torch.nn.functional.one_hot,),
    gather: (torch.gather, "gather"),
    index_add: (torch.index_add, "index_add"),
    experts: (moe_experts,),
    histc: (torch.histc, "histc"),
}
