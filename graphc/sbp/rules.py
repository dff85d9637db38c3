"""SBP rules: for each op, the valid signatures on one mesh axis (see docs/sbp.md).

A rule gets a RuleCtx and returns candidates `(required, out)`: `required` maps input
nodes to the SBP the op needs them in (inputs not named keep their producer's SBP) and
`out` is the output's SBP. The all-broadcast signature is always valid and is added by
the chooser, so a rule lists only the sharded ones. An op without a rule (or whose rule
returns None: a case it does not cover) runs on gathered (broadcast) inputs and is marked
as a fallback.
"""
from __future__ import annotations

import math
import operator
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..meta import META_PIECES, META_SBP, META_TENSOR
from . import local_ops, routing
from .context_parallel import sequence_signature
from .tensor_index import index_by_tensors
from .context import Candidate, RuleCtx  # noqa: F401 (rules and their callers read them here)
from .layout import B, P, S, chunk_sizes


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


RULES: Dict[object, Callable[[RuleCtx], List[Candidate]]] = {}


def _register(rule, *keys):
    for k in keys:
        RULES[k] = rule


_register(matmul, torch.matmul, operator.matmul, torch.mm, torch.bmm, "matmul", "mm", "bmm")
_register(linear, F.linear)
_register(addmm, torch.addmm)
_register(additive, operator.add, operator.sub, torch.add, torch.sub, "add", "sub")
_register(multiplicative, operator.mul, operator.truediv, torch.mul, torch.div, "mul", "div")
_register(linear_unary, operator.neg, torch.neg, "neg", "contiguous", "clone")
_register(elementwise, F.relu, torch.relu, "relu", F.gelu, F.silu, torch.tanh, "tanh",
          torch.sigmoid, "sigmoid", F.dropout, torch.exp, "exp", F.sigmoid, F.tanh)
_register(softmax, F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, "softmax",
          "log_softmax")
_register(layer_norm, F.layer_norm)
_register(embedding, F.embedding)
_register(reduction, torch.sum, torch.mean, "sum", "mean")
_register(pick_along, torch.argmax, torch.argmin, torch.amax, torch.amin, "argmax", "argmin", "amax", "amin")
_register(cross_entropy, F.cross_entropy)
_register(mse_loss, F.mse_loss)
_register(reshape, torch.reshape, torch.flatten, "view", "reshape", "flatten", torch.unflatten,
          "unflatten")
_register(permute, torch.transpose, torch.permute, "transpose", "permute", "t")
_register(cat, torch.cat)
_register(split_op, torch.split, torch.chunk, "split", "chunk")
_register(attention, F.scaled_dot_product_attention)
_register(elementwise, "masked_fill", "masked_fill_", torch.masked_fill, torch.where,
          operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
          torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge,
          "eq", "ne", "lt", "le", "gt", "ge", "logical_not", torch.logical_not, operator.invert,
          "rsqrt", torch.rsqrt, "sqrt", torch.sqrt, "pow", torch.pow, operator.pow, "abs", torch.abs,
          F.relu6, F.leaky_relu, F.elu, F.hardtanh, F.hardswish, F.softplus, F.mish,
          F.selu, F.celu, F.hardsigmoid, F.logsigmoid, F.softsign, F.tanhshrink, F.threshold)
_register(triangular, torch.tril, torch.triu, "tril", "triu")
_register(expand, "expand", torch.broadcast_to, "broadcast_to")
_register(set_item, local_ops.set_item)
_register(index, "__getitem__")   # a whole tensor indexed by a traced one: table[ids]
_register(flip, torch.flip, "flip")
_register(pad, F.pad)
_register(filled_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like)
_register(created_from, "new_zeros", "new_ones", "new_full", "new_empty")
_register(cast, "float", "double", "half", "bfloat16", "to", "type", "type_as", "long", "int", "short", "bool", "byte")
_register(metadata, "size", "dim", "numel", "nelement", "ndimension", "get_device")
_register(conv, F.conv1d, F.conv2d, F.conv3d)
_register(_pool(1, False), F.max_pool1d, F.adaptive_max_pool1d)
_register(_pool(2, False), F.max_pool2d, F.adaptive_max_pool2d)
_register(_pool(1, True), F.avg_pool1d, F.adaptive_avg_pool1d)
_register(_pool(2, True), F.avg_pool2d, F.adaptive_avg_pool2d)
_register(per_sample, F.group_norm)
_register(batch_norm_eval, F.batch_norm)
_register(batch_norm_sum, local_ops.batch_norm_sum)
_register(batch_norm_stats, local_ops.batch_norm_stats)
_register(batch_norm_apply, local_ops.batch_norm_apply)
_register(replicated, local_ops.batch_norm_update_, local_ops.batch_norm_deferred_update_)
for _rule, _targets in routing.ROUTING_OPS.items():
    _register(_rule, *_targets)
_METADATA_ATTRS = ("shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad")


def rule_for(node: fx.Node) -> Optional[Callable[[RuleCtx], List[Candidate]]]:
    if node.op == "call_function" and node.target is operator.getitem:
        src = node.args[0]
        if isinstance(src, fx.Node) and src.meta.get(META_TENSOR) is None:
            return passthrough
        return index
    if node.op == "call_function" and node.target is getattr:
        return metadata if node.args[1] in _METADATA_ATTRS else None
    if node.op in ("call_function", "call_method"):
        try:
            return RULES.get(node.target)
        except TypeError:  # unhashable target
            return None
    return None


_RANDOM = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal, torch.bernoulli,
           torch.multinomial, torch.poisson}


def draws_random(node: fx.Node) -> bool:
    """Does the op draw random numbers? Then equal results on every rank are not given."""
    return node.op == "call_function" and node.target in _RANDOM
