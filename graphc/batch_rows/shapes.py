"""Rules of elementwise ops, reductions, ops along a dim, and ops that move dims.

Each rule takes a Ctx (graphc/batch_rows/context.py) and returns the node's Rows (a tuple or
Each for several tensors, None for a non-tensor); see graphc/batch_rows/rules.py for the table.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional

import torch
import torch.fx as fx

from . import Each, Rows
from .context import (Ctx, broadcast_rows, combine_reduced, in_order, norm_dim, norm_dims, op_name,
                      whole_sums_or_couple)


# -- elementwise ------------------------------------------------------------------------
def elementwise(linear: bool):
    def rule(ctx: Ctx):
        parts = ctx.tensors()
        if not parts:
            return None
        return Rows(broadcast_rows(ctx, parts), combine_reduced(ctx, parts, linear))
    return rule


def multiply(ctx: Ctx):
    """a * b is linear in each factor: a product of two batch means is not."""
    parts = ctx.tensors()
    if not parts:
        return None
    if sum(1 for r in parts if r.reduced) > 1:
        whole_sums_or_couple(ctx, "two sums or means over the batch are multiplied")
    return Rows(broadcast_rows(ctx, parts), combine_reduced(ctx, parts))


def divide(ctx: Ctx):
    """a / b is linear in a; dividing by a batch sum (a data-dependent count) is not, unless
    the count has no gradient and takes the whole batch's value (NOTE: Whole-batch sums)."""
    b = ctx.rows(1)
    if b is not None and b.reduced:
        whole_sums_or_couple(ctx, "a value is divided by a sum or mean over the batch (a count "
                             "that per micro-batch would be the micro-batch's own)", linear_args=1)
        parts = ctx.tensors()
        return Rows(broadcast_rows(ctx, parts), combine_reduced(ctx, parts))
    return multiply(ctx)


def identity(ctx: Ctx):
    x = ctx.rows(0)
    return x if x is None else Rows(x.dims, x.reduced)


# -- reductions and ops along a dim -----------------------------------------------------------
def reduction(dim_at: int, linear: bool, pair_out: bool = False):
    def rule(ctx: Ctx):
        x, out = ctx.rows(0), ctx.shape()
        if x is None:
            return None
        dim = ctx.arg(dim_at, "dim")
        if isinstance(dim, (fx.Node, torch.Tensor)):  # torch.max(a, b): elementwise
            return elementwise(False)(ctx)
        gone = norm_dims(dim, len(x.dims))
        syms = [x.dims[d] for d in gone]
        if not linear:
            ctx.couple(syms, f"'{op_name(ctx)}' runs across the batch's rows")
        keep = out is not None and len(out) == len(x.dims)
        dims = tuple(None if d in gone else s for d, s in enumerate(x.dims) if keep or d not in gone)
        summed = frozenset(s for s in syms if s is not None) if linear else frozenset()
        r = Rows(dims, combine_reduced(ctx, [x], linear) | summed)
        return (r, Rows(dims)) if pair_out or (out is None and dim is not None) else r
    return rule


def along(dim_at: int, default, linear: bool = False, tuple_out: bool = False):
    """Ops that mix the entries along one dim and keep the shape (softmax, cumsum, sort)."""
    def rule(ctx: Ctx):
        x = ctx.rows(0)
        if x is None:
            return None
        dim = ctx.arg(dim_at, "dim", default)
        if dim is None:  # nn.Softmax(dim=None): the legacy implicit dim
            dim = 0 if len(x.dims) in (0, 1, 3) else 1
        syms = [x.dims[d] for d in norm_dims(dim, len(x.dims))] if x.dims else []
        ctx.couple(syms, f"'{op_name(ctx)}' runs across the batch's rows")
        r = Rows(x.dims, combine_reduced(ctx, [x], linear))
        return (r, Rows(x.dims)) if tuple_out else r
    return rule


def normalize_last(count_at: int, count_name: str):
    """layer_norm / rms_norm: normalised over the last len(normalized_shape) dims."""
    def rule(ctx: Ctx):
        x = ctx.rows(0)
        if x is None:
            return None
        shape = ctx.module.normalized_shape if ctx.module is not None else ctx.arg(count_at, count_name)
        k = len(shape) if isinstance(shape, (list, tuple, torch.Size)) else 1
        ctx.couple(x.dims[len(x.dims) - k:], f"'{op_name(ctx)}' normalises across the batch's rows")
        return Rows(x.dims, combine_reduced(ctx, [x] + ctx.tensors()[1:]))
    return rule


def per_sample(first_mixed: int):
    """Ops on each sample whole (conv, pooling, group/instance norm): dims from
    `first_mixed` on are mixed; dim 0 keeps its rows, other dims are new."""
    def rule(ctx: Ctx):
        x, out = ctx.rows(0), ctx.shape()
        if x is None or out is None:
            return None
        ctx.couple(x.dims[first_mixed:], f"'{op_name(ctx)}' mixes a row dim of the batch")
        keep = x.dims[:min(first_mixed, len(out))]
        return Rows(keep + (None,) * (len(out) - len(keep)), combine_reduced(ctx, ctx.tensors()))
    return rule


# -- shapes -----------------------------------------------------------------------------------
def reshape(ctx: Ctx):
    """A row dim survives a reshape where the dims before it hold the same number of
    elements on both sides (flatten(0, 1) of [B, T, V] keeps B as the outer factor)."""
    x, ins, out = ctx.rows(0), ctx.shape(0), ctx.shape()
    if x is None or ins is None or out is None:
        return None
    dims: List[Optional[int]] = [None] * len(out)
    for i, s in enumerate(x.dims):
        if s is None:
            continue
        before = math.prod(ins[:i])
        j = next((j for j in range(len(out)) if math.prod(out[:j]) == before
                  and (out[j] % ins[i] == 0 or ins[i] % out[j] == 0) and (out[j] != 1 or ins[i] == 1)), None)
        if j is None:
            ctx.couple([s], "a reshape moves the batch's rows into another dim")
        else:
            dims[j] = s
    return Rows(tuple(dims), x.reduced)


def permute_dims(order_of: Callable[[Ctx, int], List[int]]):
    def rule(ctx: Ctx):
        x = ctx.rows(0)
        if x is None:
            return None
        order = order_of(ctx, len(x.dims))
        return Rows(tuple(x.dims[i] for i in order), x.reduced)
    return rule


def _transpose_order(ctx: Ctx, n: int) -> List[int]:
    order = list(range(n))
    if n >= 2:
        a, b = norm_dim(ctx.arg(1, "dim0", 0), n), norm_dim(ctx.arg(2, "dim1", 1), n)
        order[a], order[b] = order[b], order[a]
    return order


def _permute_order(ctx: Ctx, n: int) -> List[int]:
    dims = ctx.node.args[1:] or ctx.node.kwargs.get("dims", ())
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = dims[0]
    return [norm_dim(d, n) for d in dims]


def _movedim_order(ctx: Ctx, n: int) -> List[int]:
    src, dst = norm_dims(ctx.arg(1, "source"), n), norm_dims(ctx.arg(2, "destination"), n)
    rest = iter(d for d in range(n) if d not in src)
    where = dict(zip(dst, src))
    return [where[k] if k in where else next(rest) for k in range(n)]


transpose = permute_dims(_transpose_order)
permute = permute_dims(_permute_order)
movedim = permute_dims(_movedim_order)
reverse_dims = permute_dims(lambda ctx, n: list(range(n))[::-1])  # x.t()


def attribute(ctx: Ctx):
    x, attr = ctx.rows(0), ctx.node.args[1]
    if x is None:
        return None
    n = len(x.dims)
    if attr == "T":
        return Rows(tuple(reversed(x.dims)), x.reduced)
    if attr in ("mT", "mH") and n >= 2:
        return Rows(x.dims[:-2] + (x.dims[-1], x.dims[-2]), x.reduced)
    return identity(ctx)


def unsqueeze(ctx: Ctx):
    x = ctx.rows(0)
    if x is None:
        return None
    dims = list(x.dims)
    dims.insert(norm_dim(ctx.arg(1, "dim"), len(dims) + 1), None)
    return Rows(tuple(dims), x.reduced)


def squeeze(ctx: Ctx):
    x, ins = ctx.rows(0), ctx.shape(0)
    if x is None or ins is None:
        return None
    dim = ctx.arg(1, "dim")
    gone = [d for d in (range(len(ins)) if dim is None else norm_dims(dim, len(ins))) if ins[d] == 1]
    return Rows(tuple(s for d, s in enumerate(x.dims) if d not in gone), x.reduced)


def expand(ctx: Ctx):
    """expand / expand_as / broadcast_to: new leading dims; a kept dim keeps its rows."""
    x, out = ctx.rows(0), ctx.shape()
    if x is None or out is None:
        return None
    return Rows((None,) * (len(out) - len(x.dims)) + x.dims, x.reduced)


def tile(ctx: Ctx):
    """x.repeat(*sizes) / torch.tile(x, dims): each dim tiled k times, and new leading dims.
    A row dim tiled lays the batch out [r0..rn, r0..rn], a micro-batch [its rows, its rows]:
    lined up with rows repeated in place (repeat_interleave, a reshape of [n, k]) or indexed
    by position, they would meet other rows."""
    x, out = ctx.rows(0), ctx.shape()
    if x is None or out is None:
        return None
    sizes = ctx.node.args[1:] or ctx.node.kwargs.get("repeats", ctx.node.kwargs.get("dims", ()))
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple, torch.Size)):
        sizes = sizes[0]
    sizes = (1,) * (len(out) - len(sizes)) + tuple(sizes)
    dims = (None,) * (len(out) - len(x.dims)) + x.dims
    ctx.couple([s for s, k in zip(dims, sizes) if k != 1], f"'{op_name(ctx)}' tiles the batch's rows "
               "(each micro-batch would tile only its own)")
    return Rows(dims, x.reduced)


def getitem(ctx: Ctx):
    base = ctx.env.get(ctx.node.args[0]) if isinstance(ctx.node.args[0], fx.Node) else None
    index = ctx.node.args[1]
    if isinstance(base, Each):
        return base.item
    if isinstance(base, tuple):
        return base[index] if isinstance(index, int) and -len(base) <= index < len(base) else None
    x, ins = ctx.rows(0), ctx.shape(0)
    if x is None or ins is None:
        return None
    items = list(index) if isinstance(index, tuple) else [index]
    if x.position and all(i is None or i == slice(None) for i in items):
        # torch.arange(n)[:, None]: still every position in order, along one axis
        return Rows((None,) * len(ctx.shape() or ()), position=True, repeats=x.repeats)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        taken = sum(1 for i in items if i is not None and i is not Ellipsis)
        items[at:at + 1] = [slice(None)] * (len(x.dims) - taken)
    dims: list = []
    advanced: List[Rows] = []  # index tensors: broadcast together into one block of dims
    d = 0
    for item in items:
        if item is None:
            dims.append(None)
            continue
        if d >= len(x.dims):
            break
        s = x.dims[d]
        if isinstance(item, slice):
            full = (item.start in (None, 0) and item.step in (None, 1)
                    and (item.stop is None or item.stop >= ins[d]))
            if not full:
                ctx.couple([s], "a slice picks some of the batch's rows")
            dims.append(s)
        elif isinstance(item, fx.Node):
            idx, shape = ctx.rows(item), ctx.shape(item)
            if idx is not None and idx.position and idx.repeats == 1 and _along_one_axis(shape, ins[d]):
                # x[torch.arange(n)] on a dim of size n: every row, in order; reshaped
                # (arange(b)[:, None]), along the axis of the index block where it is n long
                idx = Rows(tuple(s if k == ins[d] else None for k in shape))
            elif in_order(idx, shape, ins[d]):  # each row k times, in order (MoE dispatch)
                idx = Rows((s,))
            else:
                ctx.couple([s], "an index tensor picks rows of the batch by position")
            if not advanced:
                dims.append(advanced)
            advanced.append(idx if idx is not None else Rows((None,)))
        else:  # an int
            ctx.couple([s], "an integer index picks one row of the batch")
        d += 1
    out: list = []
    for entry in dims:
        out.extend(broadcast_rows(ctx, advanced) if entry is advanced else (entry,))
    return Rows(tuple(out) + x.dims[d:], x.reduced)


def _along_one_axis(shape, n: int) -> bool:
    """Is `shape` n along one axis and 1 along every other ((n,), (n, 1), (1, n))?"""
    return shape is not None and sorted(shape)[-1:] == [n] and sum(1 for k in shape if k != 1) <= 1 \
        and (n == 1 or list(shape).count(n) == 1)


def concat(ctx: Ctx):
    parts = [ctx.rows(t) for t in ctx.arg(0, "tensors")]
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    n = len(parts[0].dims)
    dim = norm_dim(ctx.arg(1, "dim", 0), n)
    dims = []
    for k in range(n):
        found = [p.dims[k] for p in parts if k < len(p.dims)]
        if k == dim and any(s is None for s in found) and any(s is not None for s in found):
            ctx.couple(found, "rows of the batch are concatenated with other rows")
        elif k == dim and sum(1 for s in found if s is not None) > 1:
            # the whole batch is laid out [all of a, all of b], a micro-batch [its a, its b]:
            # lined up with rows kept together (repeat_interleave, a reshape of [n, 2]) they
            # meet other rows; torch.stack([a, b], 1).flatten(0, 1) keeps each row's together
            ctx.couple(found, "rows of the batch are concatenated with rows of the batch (a "
                       "micro-batch would lay out only its own; torch.stack([a, b], 1).flatten(0, 1) "
                       "keeps each row's entries together)")
        known = [s for s in found if s is not None]
        for s in known[1:]:
            ctx.unify(known[0], s)
        dims.append(known[0] if known else None)
    return Rows(tuple(dims), combine_reduced(ctx, parts))


def stack(ctx: Ctx):
    parts = [p for p in (ctx.rows(t) for t in ctx.arg(0, "tensors")) if p is not None]
    if not parts:
        return None
    dims = list(broadcast_rows(ctx, parts))
    dims.insert(norm_dim(ctx.arg(1, "dim", 0), len(dims) + 1), None)
    return Rows(tuple(dims), combine_reduced(ctx, parts))


def pieces(dim_at: int, drop: bool = False):
    """chunk / split / unbind: cutting along a row dim takes some rows of the batch."""
    def rule(ctx: Ctx):
        x = ctx.rows(0)
        if x is None:
            return None
        d = norm_dim(ctx.arg(dim_at, "dim", 0), len(x.dims))
        ctx.couple([x.dims[d]], f"'{op_name(ctx)}' cuts the batch's rows into pieces")
        dims = x.dims[:d] + x.dims[d + 1:] if drop else x.dims
        return Each(Rows(dims, x.reduced))
    return rule


def pad(ctx: Ctx):
    x = ctx.rows(0)
    if x is None:
        return None
    amounts = ctx.arg(1, "pad", ())
    padded = [len(x.dims) - 1 - k // 2 for k, p in enumerate(amounts) if p]
    ctx.couple([x.dims[d] for d in padded], "pad adds rows to the batch")
    return Rows(x.dims, x.reduced)


def triangle(ctx: Ctx):
    x = ctx.rows(0)
    if x is None:
        return None
    ctx.couple(x.dims[-2:], f"'{op_name(ctx)}' treats rows of the batch by position")
    return Rows(x.dims, x.reduced)


def diagonal(ctx: Ctx):
    x = ctx.rows(0)
    if x is None:
        return None
    ctx.couple(x.dims, f"'{op_name(ctx)}' treats rows of the batch by position")
    out = ctx.shape()
    return Rows.none(len(out)) if out is not None else None
