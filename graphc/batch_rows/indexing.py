"""Rules of ops that pick, place or route entries by index (see graphc/batch_rows/rules.py).

NOTE: Indexing along a dim. Picking entries by index along a dim that holds no row of the
batch (index_select over features, gather over classes, a lookup into a table) keeps the
batch's rows where they are, and the result lines up with the index's own rows (a table
read by token ids has the tokens' rows). Along a row dim of the batch it reads rows by
their position in the whole batch, which a micro-batch does not hold: a coupling, unless
the index holds every position in order, `torch.arange(n)` or, each k times,
`torch.arange(n).repeat_interleave(k)` (each row read from or written into itself; see
context.in_order). Placing entries (scatter_add, index_add) along a dim without rows sums
rows of the batch into bins, which is linear in the rows (a reduction over them); along a
row dim it writes rows into other rows.
"""
from __future__ import annotations

from typing import List, Optional

import torch.fx as fx

from ..meta import META_TENSOR
from . import Rows
from .context import Ctx, broadcast_rows, combine_reduced, in_order, norm_dim, op_name
from .shapes import getitem


def _tensor(ctx: Ctx, a):
    """The Rows of an argument's value, None for a number (ctx.rows would read an int as the
    position of an argument)."""
    return ctx.rows(a) if isinstance(a, fx.Node) else None


def picks(dim_at: int, drop: bool):
    """select / narrow / index_select along a dim: on a row dim, some rows of the batch."""
    def rule(ctx: Ctx):
        x = ctx.rows(0)
        if x is None:
            return None
        d = norm_dim(ctx.arg(dim_at, "dim", 0), len(x.dims))
        ins, out = ctx.shape(0), ctx.shape()
        index = ctx.arg(2, "index") if op_name(ctx) == "index_select" else None
        idx = _tensor(ctx, index)
        whole = (ins is not None and out is not None and not drop
                 and (in_order(idx, ctx.shape(index), ins[d]) if idx is not None else out[d] == ins[d]))
        if not whole:
            ctx.couple([x.dims[d]], f"'{op_name(ctx)}' picks rows of the batch")
        if drop:
            return Rows(x.dims[:d] + x.dims[d + 1:], x.reduced)
        picked = idx.dims[0] if idx is not None and idx.dims and x.dims[d] is None else x.dims[d]
        return Rows(x.dims[:d] + (picked,) + x.dims[d + 1:], combine_reduced(ctx, [x] + ([idx] if idx else [])))
    return rule


def gather(ctx: Ctx):
    """gather(x, dim, index) / take_along_dim(x, index, dim): out[.., j, ..] = x[.., index[.., j, ..], ..];
    every other dim lines x and index up."""
    take = op_name(ctx) == "take_along_dim"
    x, idx = ctx.rows(0), _tensor(ctx, ctx.arg(1, "indices") if take else ctx.arg(2, "index"))
    if x is None or idx is None:
        return None
    dim = ctx.arg(2 if take else 1, "dim")
    if dim is None:  # take_along_dim on the flattened input
        ctx.couple(x.symbols | idx.symbols, "take_along_dim without a dim reads the batch flattened")
        return Rows.none(len(idx.dims))
    d = norm_dim(dim, len(x.dims))
    ctx.couple([x.dims[d]], f"'{op_name(ctx)}' picks rows of the batch by position")
    dims = broadcast_rows(ctx, [Rows(x.dims[:d] + (None,) + x.dims[d + 1:]), idx])
    return Rows(dims, combine_reduced(ctx, [x, idx]))


def scatter(ctx: Ctx):
    """scatter / scatter_add / scatter_reduce(x, dim, index, src): src's entries written into x at
    index along dim. Summed into a dim without rows (a per-class count of the batch), they are a
    reduction over the rows of src; written (not added) or into a row dim, rows meet other rows."""
    x, idx, src = ctx.rows(0), _tensor(ctx, ctx.arg(2, "index")), _tensor(ctx, ctx.arg(3, "src"))
    if x is None or idx is None:
        return None
    d = norm_dim(ctx.arg(1, "dim"), len(x.dims))
    parts = [x, idx] + ([src] if src is not None else [])
    others = [Rows(r.dims[:d] + (None,) + r.dims[d + 1:]) for r in parts]
    dims = list(broadcast_rows(ctx, others))[-len(x.dims):]
    dims[d] = x.dims[d]
    ctx.couple([x.dims[d]], f"'{op_name(ctx)}' writes entries into rows of the batch by position")
    placed = frozenset(s for r in parts[1:] for s in [r.dims[d]] if s is not None)
    summed = op_name(ctx) == "scatter_add" or (op_name(ctx) == "scatter_reduce"
                                                and ctx.arg(4, "reduce") == "sum")
    if not summed:
        ctx.couple(placed, f"'{op_name(ctx)}' writes rows of the batch over each other")
    return Rows(tuple(dims), combine_reduced(ctx, parts) | (placed if summed else frozenset()))


def index_add(ctx: Ctx):
    """index_add(x, dim, index, source): source's slice i added to x's slice index[i] along dim.
    Into a dim without rows, source's rows there are summed into bins (linear); into a row dim
    only a position index in order keeps rows apart: `torch.arange(n).repeat_interleave(k)`
    adds each token's k expert outputs back into the token's own row (MoE dispatch)."""
    index = ctx.arg(2, "index")
    x, idx, src = ctx.rows(0), _tensor(ctx, index), _tensor(ctx, ctx.arg(3, "source"))
    if x is None or idx is None or src is None:
        return None
    d = norm_dim(ctx.arg(1, "dim"), len(x.dims))
    onto_itself = in_order(idx, ctx.shape(index), ctx.shape(0)[d])
    dims = list(broadcast_rows(ctx, [Rows(x.dims[:d] + (None,) + x.dims[d + 1:]),
                                     Rows(src.dims[:d] + (None,) + src.dims[d + 1:])]))
    if onto_itself:
        ctx.unify(x.dims[d], src.dims[d])
        dims[d] = x.dims[d] if x.dims[d] is not None else src.dims[d]
        return Rows(tuple(dims), combine_reduced(ctx, [x, src]))
    ctx.couple([x.dims[d]], f"'{op_name(ctx)}' adds entries into rows of the batch by position")
    ctx.unify(idx.dims[0] if idx.dims else None, src.dims[d])
    dims[d] = x.dims[d]
    placed = frozenset(s for s in (src.dims[d], idx.dims[0] if idx.dims else None) if s is not None)
    return Rows(tuple(dims), combine_reduced(ctx, [x, src]) | placed)


def index_write(ctx: Ctx):
    """index_fill(x, dim, index, value) / index_copy(x, dim, index, source): x's slices at index
    along dim replaced. Into a row dim that is writing rows by their position in the whole
    batch (a micro-batch would write its own rows 1 and 3); source's rows replacing slices of
    a dim without rows are written over each other."""
    index = ctx.arg(2, "index")
    x, idx = ctx.rows(0), _tensor(ctx, index)
    if x is None or idx is None:
        return None
    d = norm_dim(ctx.arg(1, "dim"), len(x.dims))
    src = _tensor(ctx, ctx.arg(3, "source", ctx.node.kwargs.get("value")))
    src = src if src is not None and len(src.dims) == len(x.dims) else None
    if not in_order(idx, ctx.shape(index), ctx.shape(0)[d]):
        ctx.couple([x.dims[d]], f"'{op_name(ctx)}' writes entries into rows of the batch by position")
        ctx.couple([src.dims[d] if src is not None else None], f"'{op_name(ctx)}' writes rows of "
                   "the batch over other entries")
    parts = [x] + ([src] if src is not None else [])
    dims = list(broadcast_rows(ctx, [Rows(r.dims[:d] + (None,) + r.dims[d + 1:]) for r in parts]))
    dims[d] = x.dims[d]
    if src is not None:
        ctx.unify(x.dims[d], src.dims[d])
    return Rows(tuple(dims), combine_reduced(ctx, [x] + ctx.tensors()[1:]))


def put(ctx: Ctx):
    """index_put(x, indices, values) / masked_scatter(x, mask, source): entries written at
    positions read from data. index_put along a row dim writes rows by their position in the
    whole batch; masked_scatter takes the source's entries in flat order, so which entry lands
    in a row counts the masked entries of every row before it."""
    x = ctx.rows(0)
    if x is None:
        return None
    if op_name(ctx) == "masked_scatter":
        source = _tensor(ctx, ctx.arg(2, "source"))
        ctx.couple(source.symbols if source is not None else [], "masked_scatter takes the source's "
                   "entries in flat order, counted across the batch's rows")
        mask = _tensor(ctx, ctx.arg(1, "mask"))
        dims = broadcast_rows(ctx, [x] + ([mask] if mask is not None else []))
        return Rows(dims, combine_reduced(ctx, ctx.tensors()))
    indices = ctx.arg(1, "indices") or ()
    for k, i in enumerate(indices):
        if isinstance(i, fx.Node) and k < len(x.dims) and not in_order(ctx.rows(i), ctx.shape(i), ctx.shape(0)[k]):
            ctx.couple([x.dims[k]], f"'{op_name(ctx)}' writes entries into rows of the batch by position")
    values = _tensor(ctx, ctx.arg(2, "values"))
    ctx.couple(values.symbols if values is not None else [], f"'{op_name(ctx)}' writes rows of the "
               "batch at positions read from data")
    return Rows(x.dims, combine_reduced(ctx, ctx.tensors()))


def repeat_interleave(ctx: Ctx):
    """x.repeat_interleave(k, dim): each entry k times in a row, so each row of the batch stays
    one contiguous block, in order (MoE dispatch: each token once per chosen expert). Counts
    given per row (a tensor) would cut the micro-batches unevenly; no dim flattens first."""
    x = ctx.rows(0)
    if x is None:
        return None
    repeats, dim = ctx.arg(1, "repeats"), ctx.arg(2, "dim")
    if repeats is None:  # torch.repeat_interleave(counts): positions, as torch.arange gives
        return Rows.none(len(ctx.shape() or (0,)))
    if dim is None and len(x.dims) == 1:  # a flat input: the same as dim 0
        dim = 0
    if dim is None:
        ctx.couple(x.symbols - {x.dims[0] if x.dims else None}, "repeat_interleave without a dim "
                   "flattens the batch's rows into another dim")
        return Rows(x.dims[:1], combine_reduced(ctx, [x]))
    d = norm_dim(dim, len(x.dims))
    counts = ctx.rows(repeats) if isinstance(repeats, fx.Node) else None
    if counts is not None and counts.dims:
        ctx.couple([x.dims[d]], "repeat_interleave repeats rows of the batch by counts from data "
                   "(micro-batches would hold unequal parts)")
    k = repeats if isinstance(repeats, int) else None
    return Rows(x.dims, combine_reduced(ctx, [x] + ctx.tensors()[1:]),
                position=x.position and k is not None, repeats=x.repeats * (k or 1))


def embedding_bag(ctx: Ctx):
    """F.embedding_bag(input, weight, offsets) / nn.EmbeddingBag(input, offsets): a [bags, n]
    input gives one row per bag (its dim 0 keeps its rows; a bag's entries are reduced);
    a flat input cut by offsets points at positions in the whole flat list."""
    module = ctx.module is not None
    x = ctx.rows(0)
    if x is None:
        return None
    offsets = _tensor(ctx, ctx.arg(1 if module else 2, "offsets"))
    weights = _tensor(ctx, ctx.arg(2 if module else 8, "per_sample_weights"))
    if weights is not None:
        broadcast_rows(ctx, [x, weights])
    if len(x.dims) == 2:
        ctx.couple([x.dims[1]], "an embedding bag reduces across rows of the batch")
        return Rows((x.dims[0], None))
    ctx.couple(x.symbols | (offsets.symbols if offsets is not None else frozenset()),
               "an embedding bag cuts a flat list of the batch's rows by offsets (positions in "
               "the whole list)")
    return Rows.none(2)


def set_item(ctx: Ctx):
    """`x[index] = value` (graphc's set_item, See NOTE: Item writes): x keeps its rows. A
    boolean mask of x's leading shape writes each row's own entries (`labels[labels == p] =
    -100`); other indexes write the region x[index] reads, so a slice, an integer or an index
    tensor along a row dim writes rows by their position (a coupling, as reading them is), and
    the value's rows line up with the region's."""
    x = ctx.rows(0)
    if x is None:
        return None
    index, value = ctx.node.args[1], _tensor(ctx, ctx.arg(2, "value"))
    if isinstance(index, fx.Node) and _is_mask(ctx, index):
        lead = broadcast_rows(ctx, [Rows(x.dims[:len(ctx.shape(index))]), ctx.rows(index)])
        ctx.couple(value.symbols if value is not None else [], "x[mask] = value takes the value's "
                   "entries in flat order, counted across the batch's rows")
        return Rows(lead + x.dims[len(lead):], combine_reduced(ctx, ctx.tensors()))
    region = getitem(ctx)
    dims = list(x.dims)
    if region is not None and value is not None:
        offset = len(region.dims) - len(value.dims)
        whole = _whole_dims(index, len(dims))
        for k, s in enumerate(value.dims):
            r = region.dims[k + offset] if k + offset >= 0 else None
            if s is not None and r is None and whole is not None and whole[k + offset] \
                    and dims[k + offset] is None and _same_size(ctx, k + offset, k):
                # rows written in place, each into its own position, of a tensor made without
                # them (T5's _shift_right: `shifted[..., 1:] = labels[..., :-1]`): x takes them
                dims[k + offset] = s
            elif s is not None and r is None:
                ctx.couple([s], "x[index] = value writes rows of the batch into other positions")
            elif s is not None:
                ctx.unify(r, s)
    return Rows(tuple(dims), combine_reduced(ctx, ctx.tensors()))


def _whole_dims(index, ndim: int) -> Optional[List[bool]]:
    """Per dim of x, whether `x[index]` keeps it whole and in place (`:` or under `...`);
    None when the index drops or adds dims (an int, None, a tensor), so dims do not line up."""
    entries = list(index) if isinstance(index, tuple) else [index]
    if any(not isinstance(e, slice) and e is not Ellipsis for e in entries) or entries.count(Ellipsis) > 1:
        return None
    if Ellipsis in entries:
        at = entries.index(Ellipsis)
        entries = entries[:at] + [slice(None)] * (ndim - len(entries) + 1) + entries[at + 1:]
    entries += [slice(None)] * (ndim - len(entries))
    return [e == slice(None) for e in entries] if len(entries) == ndim else None


def _same_size(ctx: Ctx, x_dim: int, value_dim: int) -> bool:
    x, value = ctx.shape(0), ctx.shape(2)
    return x is not None and value is not None and x[x_dim] == value[value_dim]


def _is_mask(ctx: Ctx, index: fx.Node) -> bool:
    meta, x = index.meta.get(META_TENSOR), ctx.shape(0)
    return meta is not None and meta.dtype == "bool" and x is not None and \
        tuple(meta.shape) == tuple(x[:len(meta.shape)])
