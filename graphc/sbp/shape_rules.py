"""SBP rules of shapes and indexing: views (reshape, permute, expand), cat and split,
attention and masking, casts and metadata reads, indexing and item writes. Registered in
graphc/sbp/rules.py's RULES."""
from __future__ import annotations

import math
from typing import List

import torch
import torch.fx as fx

from ..meta import META_PIECES, META_SBP, META_TENSOR
from . import routing
from .context_parallel import sequence_signature
from .tensor_index import index_by_tensors
from .context import Candidate, RuleCtx
from .layout import B, P, S
from .arithmetic_rules import _split_candidates


# -- shape ops -------------------------------------------------------------------------
def _prefix(shape) -> List[int]:
    out, acc = [], 1
    for s in shape:
        out.append(acc)
        acc *= s
    return out


def reshape(ctx: RuleCtx) -> List[Candidate]:
    """view/reshape/flatten/unflatten: a split dim maps to the output dim that starts at the
    same offset. A dim kept as it is may be split unevenly; merging it with the dims after
    it, or cutting it, needs equal shards (chunks of the merged dim would cut elsewhere)."""
    x = ctx.node.args[0]
    ins, outs = ctx.shard_shape(x), ctx.shard_shape()   # NOTE: Nested shards
    if ins is None or outs is None or math.prod(ins) != math.prod(outs):
        ins, outs = ctx.meta(x).shape, ctx.out.shape
    pin, pout = _prefix(ins), _prefix(outs)
    cands: List[Candidate] = [({x: P}, P)]
    for d, size in enumerate(ins):
        if not ctx.splits(size) or size == 1:
            continue
        for j, osize in enumerate(outs):
            if pout[j] == pin[d] and osize != 1:
                kept = osize == size
                if kept or (ctx.divisible(size) and ctx.divisible(osize)):
                    cands.append(({x: S(d)}, S(j)))
                break
    return cands


def permute(ctx: RuleCtx) -> List[Candidate]:
    x = ctx.node.args[0]
    nd = len(ctx.meta(x).shape)
    perm = permutation(ctx.node, nd)
    return [({x: P}, P)] + [({x: S(perm[j])}, S(j)) for j in range(nd)
                            if ctx.splits(ctx.meta(x).shape[perm[j]])]


def expand(ctx: RuleCtx) -> List[Candidate]:
    """expand/expand_as/broadcast_to (GQA's repeat_kv): a split input dim that is not
    expanded stays split at its place in the output (leading dims added on the left);
    linear, so P -> P. A whole input expanded along a dim (ViT's class token expanded to the
    batch) may come out split along it, each rank expanding to its equal shard, where a
    reader of it reads a value split so. The sizes it names are made local by localize_ops."""
    x, mx, out = ctx.node.args[0], ctx.meta(ctx.node.args[0]), ctx.out
    if mx is None or out is None:
        return []
    off = len(out.shape) - len(mx.shape)
    cands: List[Candidate] = [({x: P}, P)]
    for i, size in enumerate(mx.shape):
        if size == out.shape[i + off] and ctx.splits(size):
            cands.append(({x: S(i)}, S(i + off)))
    for j, size in enumerate(out.shape):
        if (j < off or mx.shape[j - off] != size) and ctx.divisible(size) and _read_beside_split(ctx.node, j):
            cands.append(({x: B}, S(j)))
    return cands


def _read_beside_split(node: fx.Node, dim: int) -> bool:
    """Does a reader of `node` also read a value of its rank already split along `dim`? Then
    expanding a whole input straight into that split is free, where choosing each op by its
    own conversions alone (infer_sbp) would keep it whole and make the reader's partial
    sum, reduced later (ViT's class token concatenated with the split patches: the batch
    all-reduced). Elsewhere (tensor parallel) the expand stays whole."""
    nd = len(node.meta[META_TENSOR].shape)
    for user in node.users:
        for a in user.all_input_nodes:
            sig, meta = a.meta.get(META_SBP), a.meta.get(META_TENSOR)
            if a is not node and sig is not None and meta is not None and len(meta.shape) == nd \
                    and S(dim) in sig.out:
                return True
    return False


def permutation(node: fx.Node, nd: int) -> List[int]:
    """Output dim j reads input dim perm[j], for transpose/permute/t."""
    name = node.target if isinstance(node.target, str) else node.target.__name__
    if name == "t":
        return [1, 0][:nd] if nd == 2 else list(range(nd))
    if name == "transpose":
        a, b = node.args[1] % nd, node.args[2] % nd
        perm = list(range(nd))
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    dims = node.args[1:] if len(node.args) > 2 or isinstance(node.args[1], int) else node.args[1]
    return [d % nd for d in dims]


def cat(ctx: RuleCtx) -> List[Candidate]:
    """cat(tensors, dim): a split of another dim stays; P -> P. A 1-D empty tensor, which cat
    skips (HF's DynamicCache starts as torch.tensor([]) and cats the keys onto it), is read
    whole in every signature."""
    nd = len(ctx.out.shape)
    skipped = [t for t in ctx.node.args[0] if nd > 1 and ctx.meta(t) is not None and tuple(ctx.meta(t).shape) == (0,)]
    tensors = [t for t in ctx.node.args[0] if t not in skipped]
    whole = {t: B for t in skipped}
    dim = (ctx.arg(1, "dim", 0)) % nd
    cands: List[Candidate] = [({**{t: P for t in tensors}, **whole}, P)]
    for d in range(nd):
        if d != dim and ctx.splits(ctx.out.shape[d]):
            cands.append(({**{t: S(d) for t in tensors}, **whole}, S(d)))
    return cands


def split_op(ctx: RuleCtx) -> List[Candidate]:
    """split/chunk: pieces along `dim` keep any other split. A parameter stored in pieces
    (META_PIECES, see NOTE: fused pieces) split into those pieces keeps its split too."""
    x = ctx.node.args[0]
    mx = ctx.meta(x)
    nd = len(mx.shape)
    dim = ctx.arg(2, "dim", 0) % nd
    return [({x: P}, P)] + [({x: S(d)}, S(d)) for d in range(nd)
                            if (d != dim and ctx.splits(mx.shape[d]))
                            or (d == dim and _cuts_own_pieces(ctx, x, dim))]


def _cuts_own_pieces(ctx: RuleCtx, x, dim: int) -> bool:
    """Is the node torch.split(x, sizes, dim) of a parameter stored in pieces of those sizes
    along dim, each piece divisible over the axis (See NOTE: fused pieces)?"""
    pieces = x.meta.get(META_PIECES) if isinstance(x, fx.Node) else None
    sizes = ctx.arg(1, "split_size_or_sections")
    return (pieces is not None and ctx.node.target in (torch.split, "split") and pieces.dim == dim
            and isinstance(sizes, (list, tuple)) and tuple(sizes) == pieces.sizes
            and all(ctx.divisible(n) for n in sizes))


def passthrough(ctx: RuleCtx) -> List[Candidate]:
    """getitem of a tuple (split/chunk results): the element keeps the tuple's SBP."""
    src = ctx.node.args[0]
    return [({}, ctx.prod[src])]



# -- attention and masking -------------------------------------------------------------
def _aligned(ctx: RuleCtx, t, d: int, r: int, size: int, allow_fewer: bool = False):
    """SBP that input `t`, aligned from the right with an output of rank r, needs so that
    output dim d of `size` can be S(d): S of its dim, B where it broadcasts (size 1 or
    absent), None where neither holds. allow_fewer: a smaller divisible dim also splits
    (grouped-query heads: rank k holds kv heads k of n, serving its q heads)."""
    m = ctx.meta(t)
    if m is None:
        return None
    td = d - (r - len(m.shape))
    if td < 0 or m.shape[td] == 1:
        return B
    if m.shape[td] == size or (allow_fewer and size % m.shape[td] == 0 and ctx.divisible(m.shape[td])):
        return S(td)
    return None


def attention(ctx: RuleCtx) -> List[Candidate]:
    """scaled_dot_product_attention(q, k, v, attn_mask, ...) on [..., heads, L, E]: split any
    batch or head dim (Megatron's heads split), never L or E (a query reads every key; the
    causal mask counts global positions along L and S), unless context parallelism
    stamped the call: then also L (See NOTE: Context parallel). Nonlinear: never partial."""
    q, k, v = ctx.node.args[0], ctx.arg(1, "key"), ctx.arg(2, "value")
    mask, out = ctx.arg(3, "attn_mask"), ctx.out
    if out is None or any(ctx.meta(t) is None for t in (q, k, v)):
        return []
    r = len(out.shape)
    gqa = bool(ctx.arg(7, "enable_gqa", False))
    cands: List[Candidate] = []
    for d in range(r - 2):
        if not ctx.splits(out.shape[d]):
            continue
        req = {q: _aligned(ctx, q, d, r, out.shape[d])}
        for t in (k, v):
            req[t] = _aligned(ctx, t, d, r, out.shape[d], allow_fewer=gqa and d == r - 3)
        if ctx.meta(mask) is not None:
            req[mask] = _aligned(ctx, mask, d, r, out.shape[d])
        if all(s is not None for s in req.values()) and req[q] != B:
            cands.append((req, S(d)))
    return cands + sequence_signature(ctx)


def triangular(ctx: RuleCtx) -> List[Candidate]:
    """tril/triu act on the last two dims: split the others; linear, so P->P."""
    r = len(ctx.out.shape)
    return [c for c in _split_candidates(ctx) if c[1].dim < r - 2] + \
        [({ctx.node.args[0]: P}, P)]


# -- casts and metadata ----------------------------------------------------------------


def cast(ctx: RuleCtx) -> List[Candidate]:
    """float()/to()/type_as(): any split of the first input; P stays P only through a cast
    that is exact (the same dtype, or a widening one: bf16/fp16 -> fp32 -> fp64), where
    the cast of a sum is the sum of the casts. Through a narrowing cast (HF's RMSNorm
    `.to(torch.float32)` of a float64 value) each rank's addend would be rounded before
    the sum, where eager rounds the sum once: the value is reduced first. type_as's other
    tensor only lends its dtype: it keeps its layout."""
    x, mx, out = ctx.node.args[0], ctx.meta(ctx.node.args[0]), ctx.out
    if mx is None or out is None:
        return []
    cands: List[Candidate] = [({x: S(d)}, S(d)) for d, size in enumerate(mx.shape)
                              if ctx.splits(size)]
    if _exact_cast(mx.dtype, out.dtype):
        cands.append(({x: P}, P))
    return cands


# dtype name -> the float dtypes it casts to exactly (every value representable)
_WIDER = {"bfloat16": {"bfloat16", "float32", "float64"}, "float16": {"float16", "float32", "float64"},
          "float32": {"float32", "float64"}, "float64": {"float64"}}


def _exact_cast(src: str, dst: str) -> bool:
    return dst in _WIDER.get(src, ())


def metadata(ctx: RuleCtx) -> List[Candidate]:
    """size()/shape/dim()/numel()/dtype/device read no values: the input keeps its layout
    and the (host) result is the same on every rank; localize_ops makes size, shape and
    numel read the global value."""
    return [({}, B)]


def replicated(ctx: RuleCtx) -> List[Candidate]:
    """An op graphc itself inserts that runs on whole (broadcast) values only."""
    return []


# -- indexing ---------------------------------------------------------------------------
def _index_map(index, nd: int):
    """For basic indexing x[index]: per input dim, (output dim or None, kept whole?).
    None when the index is not basic (tensors, lists: advanced indexing)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(isinstance(i, bool) or not (i is None or i is Ellipsis or isinstance(i, (int, slice)))
           for i in items):
        return None
    if sum(i is Ellipsis for i in items) > 1:
        return None
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    expanded = []
    for i in items:
        expanded += [slice(None)] * (nd - used) if i is Ellipsis else [i]
    expanded += [slice(None)] * (nd - sum(1 for i in expanded if i is not None))
    dims, j = [], 0
    for i in expanded:
        if i is None:
            j += 1
        elif isinstance(i, int):
            dims.append((None, False))
        else:
            whole = i.start in (None, 0) and i.stop is None and i.step in (None, 1)
            dims.append((j, whole))
            j += 1
    return dims


def index(ctx: RuleCtx) -> List[Candidate]:
    """x[basic index]: a dim taken whole (`:`) keeps its split; indexing is linear (P->P).
    One integer tensor as the index is a lookup (routing.index_by_tensor), several a gather
    (tensor_index.index_by_tensors); list indices have no rule."""
    x, items = ctx.node.args[0], ctx.node.args[1]
    mx = ctx.meta(x)
    if isinstance(items, fx.Node):   # one index tensor: a lookup (See NOTE: Routing keeps the batch split)
        return routing.index_by_tensor(ctx, x, items)
    if isinstance(items, tuple) and any(isinstance(i, fx.Node) for i in items):   # several: a gather
        return index_by_tensors(ctx, x, items)
    dims = _index_map(items, len(mx.shape)) if mx is not None else None
    if dims is None:
        return None
    cands: List[Candidate] = [({x: P}, P)]
    for d, (j, whole) in enumerate(dims):
        if whole and ctx.splits(mx.shape[d]):
            cands.append(({x: S(d)}, S(j)))
    return cands


def set_item(ctx: RuleCtx) -> List[Candidate]:
    """`x[index] = value` (set_item, See NOTE: Item writes): with a basic index a dim of x
    taken whole keeps its split, the value split alike where it spans that dim (whole where
    it is 1 or absent); a boolean mask of x's leading shape splits with x. An overwrite, so
    never partial. Index tensors and new axes have no rule."""
    x, index, value = ctx.node.args[0], ctx.node.args[1], ctx.arg(2, "value")
    mx, mv = ctx.meta(x), ctx.meta(value)
    if mx is None:
        return []
    if isinstance(index, fx.Node):
        mi = ctx.meta(index)
        if mi is None or mi.dtype != "bool" or tuple(mi.shape) != tuple(mx.shape[:len(mi.shape)]) or \
                (mv is not None and math.prod(mv.shape) != 1):
            return None
        vals = {value: B} if mv is not None else {}
        return [({x: S(d), index: S(d), **vals}, S(d)) for d in range(len(mi.shape)) if ctx.splits(mx.shape[d])]
    items = index if isinstance(index, tuple) else (index,)
    dims = _index_map(index, len(mx.shape)) if not any(i is None for i in items) else None
    if dims is None:
        return None
    region = sum(1 for j, _ in dims if j is not None)
    cands: List[Candidate] = []
    for d, (j, whole) in enumerate(dims):
        if not whole or not ctx.splits(mx.shape[d]):
            continue
        req = {x: S(d)}
        if mv is not None:
            k = j - (region - len(mv.shape))
            req[value] = S(k) if k >= 0 and mv.shape[k] != 1 else B
        cands.append((req, S(d)))
    return cands

