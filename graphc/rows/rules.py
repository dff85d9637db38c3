"""How each op moves the batch's rows (see graphc/rows/__init__.py); used by find_batch_dims.

`rows_of(ctx)` returns a node's value: a Rows for a tensor, a tuple or Each for sequences
of tensors, None for anything else. Rules are looked up by the op's name (torch.add,
Tensor.add, operator.add all read "add"; in-place "add_" reads "add") or module type.
An op without a rule keeps its first input's rows where its output keeps that input's
shape (or leading size); otherwise its rows are lost and the inputs feeding only it are
computed whole in every micro-batch (exact, without the memory saving).
"""
from __future__ import annotations

import math
import operator
from typing import Callable, Dict, List, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from ..meta import META_TENSOR
from . import Coupling, Each, Rows, Symbols


class Ctx:
    """One node's inputs as Rows, its shapes, and the symbol table it may unify in."""

    def __init__(self, node: fx.Node, env: Dict[fx.Node, object], syms: Symbols,
                 events: List[Coupling], module: Optional[nn.Module] = None):
        self.node, self.env, self.syms, self.events, self.module = node, env, syms, events, module

    def arg(self, i: int, name: str, default=None):
        args = self.node.args
        return args[i] if len(args) > i else self.node.kwargs.get(name, default)

    def rows(self, a) -> Optional[Rows]:
        """a's Rows (a node or the index of an argument); None if it is not a tensor."""
        if isinstance(a, int) and not isinstance(a, bool):
            a = self.arg(a, "")
        if not isinstance(a, fx.Node):
            return None
        value = self.env.get(a)
        if isinstance(value, Rows):
            return value
        meta = a.meta.get(META_TENSOR)
        return Rows.none(len(meta.shape)) if meta is not None else None

    def shape(self, a=None) -> Optional[tuple]:
        node = self.node if a is None else (self.arg(a, "") if isinstance(a, int) else a)
        meta = node.meta.get(META_TENSOR) if isinstance(node, fx.Node) else None
        return tuple(meta.shape) if meta is not None else None

    def tensors(self) -> List[Rows]:
        return [r for r in (self.rows(a) for a in _flat_nodes(self.node)) if r is not None]

    def unify(self, a: Optional[int], b: Optional[int]) -> None:
        self.syms.union(a, b)

    def couple(self, symbols, why: str, meets=None) -> None:
        symbols = frozenset(s for s in symbols if s is not None)
        if symbols:
            self.events.append(Coupling(self.node, why, symbols,
                                        None if meets is None else frozenset(meets)))


def _flat_nodes(node: fx.Node) -> List[fx.Node]:
    found: List[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n))
    return found


def _dim(d, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _dims(d, ndim: int) -> List[int]:
    if d is None:
        return list(range(ndim))
    return [_dim(x, ndim) for x in (d if isinstance(d, (list, tuple)) else [d])]


def _reduced(ctx: Ctx, parts: List[Rows], linear: bool = True):
    """The union of the inputs' reduced symbols, reporting the two nonlinear uses: a batch
    mean combined with the batch's own rows (x - x.mean(0)), or put through a nonlinear op."""
    dims = frozenset().union(*(r.symbols for r in parts)) if parts else frozenset()
    out = frozenset().union(*(r.reduced for r in parts)) if parts else frozenset()
    for r in parts:
        if r.reduced and dims:
            ctx.couple(r.reduced, "a sum or mean over the batch meets the batch's own rows", dims)
    if out and not linear:
        ctx.couple(out, "a sum or mean over the batch goes through a nonlinear op")
    return out


# -- elementwise ------------------------------------------------------------------------
def _broadcast(ctx: Ctx, parts: List[Rows]) -> tuple:
    n = max((len(r.dims) for r in parts), default=0)
    out = []
    for k in range(n):
        found = [r.dims[k - n + len(r.dims)] for r in parts if k - n + len(r.dims) >= 0]
        found = [s for s in found if s is not None]
        for s in found[1:]:
            ctx.unify(found[0], s)
        out.append(found[0] if found else None)
    return tuple(out)


def elementwise(linear: bool):
    def rule(ctx: Ctx):
        parts = ctx.tensors()
        if not parts:
            return None
        return Rows(_broadcast(ctx, parts), _reduced(ctx, parts, linear))
    return rule


def multiply(ctx: Ctx):
    """a * b is linear in each factor: a product of two batch means is not."""
    parts = ctx.tensors()
    if not parts:
        return None
    if sum(1 for r in parts if r.reduced) > 1:
        ctx.couple(frozenset().union(*(r.reduced for r in parts)), "two sums or means over the "
                   "batch are multiplied")
    return Rows(_broadcast(ctx, parts), _reduced(ctx, parts))


def divide(ctx: Ctx):
    """a / b is linear in a; dividing by a batch sum (a data-dependent count) is not."""
    b = ctx.rows(1)
    if b is not None and b.reduced:
        ctx.couple(b.reduced, "a value is divided by a sum or mean over the batch (a count "
                   "that per micro-batch would be the micro-batch's own)")
        parts = ctx.tensors()
        return Rows(_broadcast(ctx, parts), _reduced(ctx, parts))
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
        gone = _dims(dim, len(x.dims))
        syms = [x.dims[d] for d in gone]
        if not linear:
            ctx.couple(syms, f"'{_name(ctx)}' runs across the batch's rows")
        keep = out is not None and len(out) == len(x.dims)
        dims = tuple(None if d in gone else s for d, s in enumerate(x.dims) if keep or d not in gone)
        reduced = _reduced(ctx, [x], linear) | (frozenset(s for s in syms if s is not None) if linear else frozenset())
        r = Rows(dims, reduced)
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
        syms = [x.dims[d] for d in _dims(dim, len(x.dims))] if x.dims else []
        ctx.couple(syms, f"'{_name(ctx)}' runs across the batch's rows")
        r = Rows(x.dims, _reduced(ctx, [x], linear))
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
        ctx.couple(x.dims[len(x.dims) - k:], f"'{_name(ctx)}' normalises across the batch's rows")
        return Rows(x.dims, _reduced(ctx, [x] + ctx.tensors()[1:]))
    return rule


def per_sample(first_mixed: int):
    """Ops on each sample whole (conv, pooling, group/instance norm): dims from
    `first_mixed` on are mixed; dim 0 keeps its rows, other dims are new."""
    def rule(ctx: Ctx):
        x, out = ctx.rows(0), ctx.shape()
        if x is None or out is None:
            return None
        ctx.couple(x.dims[first_mixed:], f"'{_name(ctx)}' mixes a row dim of the batch")
        keep = x.dims[:min(first_mixed, len(out))]
        return Rows(keep + (None,) * (len(out) - len(keep)), _reduced(ctx, ctx.tensors()))
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
        a, b = _dim(ctx.arg(1, "dim0", 0), n), _dim(ctx.arg(2, "dim1", 1), n)
        order[a], order[b] = order[b], order[a]
    return order


def _permute_order(ctx: Ctx, n: int) -> List[int]:
    dims = ctx.node.args[1:] or ctx.node.kwargs.get("dims", ())
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = dims[0]
    return [_dim(d, n) for d in dims]


def _movedim_order(ctx: Ctx, n: int) -> List[int]:
    src, dst = _dims(ctx.arg(1, "source"), n), _dims(ctx.arg(2, "destination"), n)
    rest = iter(d for d in range(n) if d not in src)
    where = dict(zip(dst, src))
    return [where[k] if k in where else next(rest) for k in range(n)]


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


def reshape_to_out(ctx: Ctx):
    """unsqueeze / squeeze / expand: size-1 dims come and go; a kept dim keeps its rows."""
    x, ins, out = ctx.rows(0), ctx.shape(0), ctx.shape()
    if x is None or ins is None or out is None:
        return None
    big = [(s, size) for s, size in zip(x.dims, ins) if size != 1]
    dims, k = [], 0
    lead = len(out) - len(ins) if _name(ctx) in ("expand", "expand_as", "broadcast_to") else 0
    for j, size in enumerate(out):
        if j < lead or (size == 1 and not (k < len(big) and big[k][1] == 1)):
            dims.append(None)
        elif k < len(big):
            dims.append(big[k][0])
            k += 1
        else:
            dims.append(None)
    if _name(ctx) in ("expand", "expand_as", "broadcast_to"):
        dims = [None] * lead + list(x.dims)
    return Rows(tuple(dims), x.reduced)


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
            full = item.start in (None, 0) and item.step in (None, 1) and (item.stop is None or item.stop >= ins[d])
            if not full:
                ctx.couple([s], "a slice picks some of the batch's rows")
            dims.append(s)
        elif isinstance(item, fx.Node):
            idx = ctx.rows(item)
            if idx is not None and idx.position and ctx.shape(item) == (ins[d],):
                idx = Rows((s,))  # x[torch.arange(n)] on a dim of size n: every row, in order
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
        out.extend(_broadcast(ctx, advanced) if entry is advanced else (entry,))
    return Rows(tuple(out) + x.dims[d:], x.reduced)


def concat(ctx: Ctx):
    parts = [ctx.rows(t) for t in ctx.arg(0, "tensors")]
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    n = len(parts[0].dims)
    dim = _dim(ctx.arg(1, "dim", 0), n)
    dims = []
    for k in range(n):
        found = [p.dims[k] for p in parts if k < len(p.dims)]
        if k == dim and any(s is None for s in found) and any(s is not None for s in found):
            ctx.couple(found, "rows of the batch are concatenated with other rows")
        known = [s for s in found if s is not None]
        for s in known[1:]:
            ctx.unify(known[0], s)
        dims.append(known[0] if known else None)
    return Rows(tuple(dims), _reduced(ctx, parts))


def stack(ctx: Ctx):
    parts = [p for p in (ctx.rows(t) for t in ctx.arg(0, "tensors")) if p is not None]
    if not parts:
        return None
    dims = list(_broadcast(ctx, parts))
    dims.insert(_dim(ctx.arg(1, "dim", 0), len(dims) + 1), None)
    return Rows(tuple(dims), _reduced(ctx, parts))


def pieces(dim_at: int, drop: bool = False):
    """chunk / split / unbind: cutting along a row dim takes some rows of the batch."""
    def rule(ctx: Ctx):
        x = ctx.rows(0)
        if x is None:
            return None
        d = _dim(ctx.arg(dim_at, "dim", 0), len(x.dims))
        ctx.couple([x.dims[d]], f"'{_name(ctx)}' cuts the batch's rows into pieces")
        dims = x.dims[:d] + x.dims[d + 1:] if drop else x.dims
        return Each(Rows(dims, x.reduced))
    return rule


def picks(dim_at: int, drop: bool):
    """select / narrow / index_select along a dim: on a row dim, some rows of the batch."""
    def rule(ctx: Ctx):
        x = ctx.rows(0)
        if x is None:
            return None
        d = _dim(ctx.arg(dim_at, "dim", 0), len(x.dims))
        ins, out = ctx.shape(0), ctx.shape()
        idx = ctx.rows(2) if _name(ctx) == "index_select" else None
        whole = (ins is not None and out is not None and not drop and out[d] == ins[d]
                 and (idx is None or idx.position))
        if not whole:
            ctx.couple([x.dims[d]], f"'{_name(ctx)}' picks rows of the batch")
        return Rows(x.dims[:d] + x.dims[d + 1:] if drop else x.dims, x.reduced)
    return rule


def gather(ctx: Ctx):
    x, idx = ctx.rows(0), ctx.rows(2)
    if x is None or idx is None:
        return None
    d = _dim(ctx.arg(1, "dim"), len(x.dims))
    ctx.couple([x.dims[d]], "gather picks rows of the batch by position")
    for k, (a, b) in enumerate(zip(x.dims, idx.dims)):
        if k != d:
            ctx.unify(a, b)
    return Rows(tuple(b if b is not None else (a if k != d else None)
                      for k, (a, b) in enumerate(zip(x.dims, idx.dims))), _reduced(ctx, [x, idx]))


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
    ctx.couple(x.dims[-2:], f"'{_name(ctx)}' treats rows of the batch by position")
    return Rows(x.dims, x.reduced)


def diagonal(ctx: Ctx):
    x = ctx.rows(0)
    if x is None:
        return None
    ctx.couple(x.dims, f"'{_name(ctx)}' treats rows of the batch by position")
    out = ctx.shape()
    return Rows.none(len(out)) if out is not None else None


# -- products and layers ---------------------------------------------------------------------
def _contract(ctx: Ctx, a: Optional[int], b: Optional[int]) -> frozenset:
    """A contraction over a row dim sums a product per row: linear in the rows."""
    ctx.unify(a, b)
    return frozenset(s for s in (a, b) if s is not None)


def _product(ctx: Ctx, parts: List[Rows]) -> frozenset:
    if sum(1 for r in parts if r.reduced) > 1:
        ctx.couple(frozenset().union(*(r.reduced for r in parts)), "two sums or means over the "
                   "batch are multiplied")
    return _reduced(ctx, parts)


def matmul(ctx: Ctx):
    a, b = ctx.rows(0), ctx.rows(1)
    if a is None or b is None:
        return None
    ad, bd = a.dims, b.dims
    if len(ad) == 1 and len(bd) == 1:
        summed, out = _contract(ctx, ad[0], bd[0]), ()
    elif len(ad) == 1:
        summed, out = _contract(ctx, ad[0], bd[-2]), bd[:-2] + (bd[-1],)
    elif len(bd) == 1:
        summed, out = _contract(ctx, ad[-1], bd[0]), ad[:-1]
    else:
        summed = _contract(ctx, ad[-1], bd[-2])
        lead = _broadcast(ctx, [Rows(ad[:-2]), Rows(bd[:-2])])
        out = lead + (ad[-2], bd[-1])
    return Rows(out, _product(ctx, [a, b]) | summed)


def linear(ctx: Ctx):
    x = ctx.rows(0)
    if x is None or not x.dims:
        return None
    w = ctx.rows(1) if ctx.module is None else Rows.none(2)
    w = w if w is not None and len(w.dims) == 2 else Rows.none(2)
    summed = _contract(ctx, x.dims[-1], w.dims[1])
    bias = ctx.rows(2) if ctx.module is None else None
    if bias is not None and bias.dims:
        ctx.unify(w.dims[0], bias.dims[-1])
    return Rows(x.dims[:-1] + (w.dims[0],), _product(ctx, [x, w]) | summed)


def einsum(ctx: Ctx):
    equation = ctx.node.args[0]
    ops = ctx.node.args[1:]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = ops[0]
    parts = [ctx.rows(o) for o in ops]
    if "->" not in equation or "." in equation or any(p is None for p in parts):
        return default(ctx)
    lhs, out = equation.replace(" ", "").split("->")
    letter: Dict[str, Optional[int]] = {}
    for spec, p in zip(lhs.split(","), parts):
        for ch, s in zip(spec, p.dims):
            if letter.get(ch) is None:
                letter[ch] = s
            else:
                ctx.unify(letter[ch], s)
    summed = frozenset(s for ch, s in letter.items() if ch not in out and s is not None)
    return Rows(tuple(letter.get(ch) for ch in out), _product(ctx, parts) | summed)


def attention(ctx: Ctx):
    """scaled_dot_product_attention: a softmax over the keys' positions."""
    q, k, v = ctx.rows(0), ctx.rows(1), ctx.rows(2)
    if q is None or k is None or v is None:
        return None
    ctx.couple([k.dims[-2], v.dims[-2]], "attention runs across the batch's rows")
    _contract(ctx, q.dims[-1], k.dims[-1])
    lead = _broadcast(ctx, [Rows(q.dims[:-2]), Rows(k.dims[:-2]), Rows(v.dims[:-2])])
    return Rows(lead + (q.dims[-2], v.dims[-1]), _reduced(ctx, [q, k, v], linear=False))


def embedding(ctx: Ctx):
    idx = ctx.rows(0)
    if idx is None:
        return None
    w = ctx.rows(1) if ctx.module is None else None
    if w is not None and len(w.dims) == 2:
        ctx.couple([w.dims[0]], "an embedding looks up rows of the batch by index")
        return Rows(idx.dims + (w.dims[1],))
    return Rows(idx.dims + (None,))


def one_hot(ctx: Ctx):
    y = ctx.rows(0)
    return None if y is None else Rows(y.dims + (None,))


def distance(dim_at: int, default_dim: int):
    """cosine_similarity / pairwise_distance: two inputs lined up, reduced along one dim."""
    def rule(ctx: Ctx):
        a, b = ctx.rows(0), ctx.rows(1)
        if a is None or b is None:
            return None
        dims = _broadcast(ctx, [a, b])
        d = _dim(ctx.arg(dim_at, "dim", default_dim), len(dims))
        ctx.couple([dims[d]], f"'{_name(ctx)}' reduces across the batch's rows")
        out = ctx.shape()
        keep = out is not None and len(out) == len(dims)
        return Rows(tuple(s if k != d else None for k, s in enumerate(dims) if keep or k != d),
                    _reduced(ctx, [a, b], linear=False))
    return rule


def outer_pairs(ctx: Ctx):
    """cdist / outer: every row of one input against every row of the other."""
    a, b = ctx.rows(0), ctx.rows(1)
    if a is None or b is None:
        return None
    if _name(ctx) == "outer":
        return Rows((a.dims[0], b.dims[0]), _product(ctx, [a, b]))
    ctx.couple([a.dims[-1], b.dims[-1]], "cdist reduces across the batch's rows")
    lead = _broadcast(ctx, [Rows(a.dims[:-2]), Rows(b.dims[:-2])])
    return Rows(lead + (a.dims[-2], b.dims[-2]), _reduced(ctx, [a, b], linear=False))


# -- losses -----------------------------------------------------------------------------------
def class_loss(ctx: Ctx):
    """cross_entropy / nll_loss: rows of input and target line up; classes are dim 1."""
    x, y = ctx.rows(0), ctx.rows(1)
    if x is None or y is None:
        return None
    _reduced(ctx, [x, y], linear=False)
    if len(x.dims) == 1:
        ctx.couple([x.dims[0]], "the loss's classes are rows of the batch")
        rows: tuple = ()
    elif len(y.dims) == len(x.dims):  # class probabilities as targets
        dims = _broadcast(ctx, [x, y])
        ctx.couple([dims[1]], "the loss's classes are rows of the batch")
        rows = dims[:1] + dims[2:]
    else:
        ctx.couple([x.dims[1]], "the loss's softmax runs across rows of the batch (its "
                   "classes are the batch's rows)")
        rows = _broadcast(ctx, [Rows(x.dims[:1] + x.dims[2:]), y])
    weight = ctx.rows(2) if ctx.module is None else None
    if weight is not None:
        ctx.couple(weight.dims, "the loss's class weights are rows of the batch")
    return _loss_out(ctx, rows)


def pointwise_loss(ctx: Ctx):
    """mse, l1, bce, kl_div, ...: inputs lined up element by element, then reduced."""
    parts = [r for r in (ctx.rows(a) for a in _flat_nodes(ctx.node)) if r is not None]
    if not parts:
        return None
    _reduced(ctx, parts, linear=False)
    return _loss_out(ctx, _broadcast(ctx, parts))


def _loss_out(ctx: Ctx, rows: tuple):
    reduction = ctx.module.reduction if ctx.module is not None else ctx.node.kwargs.get("reduction", "mean")
    if reduction == "none":
        return Rows(rows)
    return Rows((), frozenset(s for s in rows if s is not None))


# -- creation -------------------------------------------------------------------------------
def created(ctx: Ctx):
    out = ctx.shape()
    if out is None:
        return None
    start_only = len(ctx.node.args) == 1 or (len(ctx.node.args) == 2 and ctx.node.args[0] == 0)
    return Rows((None,) * len(out), position=_name(ctx) == "arange" and start_only and len(out) == 1)


def like(ctx: Ctx):
    x = ctx.rows(0)
    return None if x is None else Rows(x.dims)


def rnn(ctx: Ctx):
    """nn.RNN / LSTM / GRU: the recurrence runs along the time dim (dim 1 when batch_first)."""
    x = ctx.rows(0)
    if x is None or len(x.dims) < 2:
        return None
    first = getattr(ctx.module, "batch_first", False)
    batch, time = (x.dims[0], x.dims[1]) if first else (x.dims[1], x.dims[0])
    ctx.couple([time], "a recurrence runs along the batch's rows (a sequence-first RNN "
               "whose dim 0 is time)")
    out = (batch, None, None) if first else (None, batch, None)
    return (Rows(out), Each(Rows((None, batch, None))))


def multihead_attention(ctx: Ctx):
    q, k = ctx.rows(0), ctx.rows(1)
    if q is None or k is None or len(k.dims) < 3:
        return None
    first = getattr(ctx.module, "batch_first", False)
    ctx.couple([k.dims[1] if first else k.dims[0]], "attention runs across the batch's rows")
    return (Rows(q.dims), None)


def default(ctx: Ctx):
    """No rule: rows kept where the output keeps its first input's shape or leading size."""
    parts = ctx.tensors()
    out = ctx.shape()
    if out is None:
        return None
    if not parts:
        return Rows.none(len(out))
    first = parts[0]
    first_node = next(a for a in _flat_nodes(ctx.node) if ctx.rows(a) is not None)
    ins = ctx.shape(first_node)
    reduced = _reduced(ctx, parts, linear=False)
    if ins is not None and tuple(ins) == tuple(out):
        return Rows(first.dims, reduced)
    if ins and out and ins[0] == out[0]:
        return Rows((first.dims[0],) + (None,) * (len(out) - 1), reduced)
    return Rows.none(len(out))


def _name(ctx: Ctx) -> str:
    t = ctx.node.target
    name = t if isinstance(t, str) else getattr(t, "__name__", str(t))
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name.strip("_")


# -- the tables -------------------------------------------------------------------------------
_LINEAR = ("add", "sub", "rsub", "neg", "positive", "clone", "contiguous", "detach", "to", "float",
           "double", "half", "bfloat16", "type", "requires_grad", "cpu", "cuda",
           "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
           "to_global_op", "sum_to_size", "real", "conj", "iadd", "isub", "radd")
_NONLINEAR = ("relu", "gelu", "silu", "sigmoid", "tanh", "exp", "exp2", "log", "log2", "log10",
              "log1p", "expm1", "sqrt", "rsqrt", "abs", "pow", "square", "sin", "cos", "clamp", "clip",
              "clamp_min", "clamp_max", "where", "maximum", "minimum", "fmax", "fmin", "masked_fill",
              "leaky_relu", "elu", "selu", "celu", "softplus", "mish", "hardtanh", "relu6",
              "hardswish", "hardsigmoid", "logsigmoid", "softsign", "tanhshrink", "threshold",
              "erf", "erfc", "sign", "sgn", "floor", "ceil", "round", "trunc", "frac", "reciprocal",
              "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not",
              "logical_xor", "and", "or", "xor", "invert", "bitwise_not", "bitwise_and",
              "bitwise_or", "isnan", "isinf", "isfinite", "nan_to_num", "lerp", "floordiv",
              "floor_divide", "mod", "remainder", "fmod", "atan2", "float_power", "xlogy", "prelu",
              "rrelu", "silu", "logit", "sinh", "cosh", "asin", "acos", "atan", "tan", "addcmul",
              "addcdiv", "heaviside", "copysign", "masked_scatter", "index_fill", "polar",
              "hardshrink", "softshrink", "sigmoid", "bool", "long", "int", "short", "byte", "char",
              "glu")
_LINEAR_REDUCE = {"sum": 1, "mean": 1, "nansum": 1, "nanmean": 1}
_OTHER_REDUCE = {"prod": 1, "amax": 1, "amin": 1, "max": 1, "min": 1, "argmax": 1, "argmin": 1,
                 "logsumexp": 1, "std": 1, "var": 1, "median": 1, "nanmedian": 1, "mode": 1,
                 "all": 1, "any": 1, "count_nonzero": 1, "norm": 2, "vector_norm": 2,
                 "std_mean": 1, "var_mean": 1, "aminmax": 1}
_TUPLE_REDUCE = ("std_mean", "var_mean", "aminmax", "mode")

RULES: Dict[str, Callable] = {}
RULES.update({n: elementwise(True) for n in _LINEAR})
RULES.update({n: elementwise(False) for n in _NONLINEAR})
RULES.update({n: reduction(at, True) for n, at in _LINEAR_REDUCE.items()})
RULES.update({n: reduction(at, False, n in _TUPLE_REDUCE) for n, at in _OTHER_REDUCE.items()})
RULES.update({
    "mul": multiply, "imul": multiply, "truediv": divide, "div": divide, "divide": divide,
    "true_divide": divide, "itruediv": divide,
    "softmax": along(1, None), "log_softmax": along(1, None), "softmin": along(1, None),
    "cumsum": along(1, None, linear=True), "cumprod": along(1, None), "logcumsumexp": along(1, None),
    "cummax": along(1, None, tuple_out=True), "cummin": along(1, None, tuple_out=True),
    "sort": along(1, -1, tuple_out=True), "argsort": along(1, -1), "flip": along(1, None, linear=True),
    "roll": along(2, None, linear=True), "normalize": along(2, 1), "topk": along(2, -1, tuple_out=True),
    "kthvalue": along(2, -1, tuple_out=True), "diff": along(2, -1, linear=True),
    "layer_norm": normalize_last(1, "normalized_shape"), "rms_norm": normalize_last(1, "normalized_shape"),
    "group_norm": per_sample(1), "instance_norm": per_sample(2),
    # BatchNorm in training mode normalises over the batch: see the BatchNorm row of issue 14
    # (deferred batch norm); here it keeps rows like any per-row op
    "batch_norm": identity,
    "conv1d": per_sample(1), "conv2d": per_sample(1), "conv3d": per_sample(1),
    "conv_transpose1d": per_sample(1), "conv_transpose2d": per_sample(1),
    "conv_transpose3d": per_sample(1), "max_pool1d": per_sample(1), "max_pool2d": per_sample(1),
    "max_pool3d": per_sample(1), "avg_pool1d": per_sample(1), "avg_pool2d": per_sample(1),
    "avg_pool3d": per_sample(1), "adaptive_avg_pool1d": per_sample(1),
    "adaptive_avg_pool2d": per_sample(1), "adaptive_max_pool2d": per_sample(1),
    "interpolate": per_sample(1),
    "view": reshape, "reshape": reshape, "flatten": reshape, "unflatten": reshape,
    "view_as": reshape, "reshape_as": reshape, "ravel": reshape,
    "transpose": permute_dims(_transpose_order), "swapaxes": permute_dims(_transpose_order),
    "swapdims": permute_dims(_transpose_order), "permute": permute_dims(_permute_order),
    "movedim": permute_dims(_movedim_order), "moveaxis": permute_dims(_movedim_order),
    "t": permute_dims(lambda ctx, n: list(range(n))[::-1]),
    "getattr": attribute, "getitem": getitem,
    "unsqueeze": reshape_to_out, "squeeze": reshape_to_out, "expand": reshape_to_out,
    "expand_as": reshape_to_out, "broadcast_to": reshape_to_out, "repeat": identity,
    "type_as": identity,
    "cat": concat, "concat": concat, "concatenate": concat, "stack": stack,
    "chunk": pieces(2), "split": pieces(2), "tensor_split": pieces(2), "split_with_sizes": pieces(2),
    "unbind": pieces(1, drop=True),
    "select": picks(1, True), "narrow": picks(1, False), "index_select": picks(1, False),
    "gather": gather, "take_along_dim": gather, "pad": pad,
    "tril": triangle, "triu": triangle, "diag": diagonal, "diagonal": diagonal,
    "diag_embed": diagonal, "trace": diagonal,
    "matmul": matmul, "mm": matmul, "bmm": matmul, "mv": matmul, "dot": matmul, "inner": matmul,
    "linear": linear, "einsum": einsum, "scaled_dot_product_attention": attention,
    "embedding": embedding, "one_hot": one_hot,
    "cosine_similarity": distance(2, 1), "pairwise_distance": distance(4, -1),
    "cdist": outer_pairs, "outer": outer_pairs,
    "cross_entropy": class_loss, "nll_loss": class_loss,
    "arange": created, "zeros": created, "ones": created, "full": created, "empty": created,
    "rand": created, "randn": created, "randint": created, "eye": created, "linspace": created,
    "tensor": created, "new_zeros": created, "new_ones": created, "new_full": created,
    "new_empty": created, "new_tensor": created, "scalar_tensor": created,
    "zeros_like": like, "ones_like": like, "full_like": like, "empty_like": like,
    "rand_like": like, "randn_like": like, "randint_like": like,
})
for _loss in ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
              "binary_cross_entropy_with_logits", "kl_div", "soft_margin_loss", "poisson_nll_loss",
              "gaussian_nll_loss", "hinge_embedding_loss", "margin_ranking_loss",
              "multilabel_soft_margin_loss"):
    RULES[_loss] = pointwise_loss

_ACTIVATION_MODULES = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.SELU,
                       nn.CELU, nn.Softplus, nn.Mish, nn.Hardtanh, nn.ReLU6, nn.Hardswish,
                       nn.Hardsigmoid, nn.LogSigmoid, nn.PReLU, nn.Softsign, nn.Tanhshrink,
                       nn.Threshold, nn.GLU)
MODULE_RULES: Dict[type, Callable] = {
    nn.Linear: linear, nn.Embedding: embedding, nn.Identity: identity,
    nn.Dropout: elementwise(True), nn.Dropout1d: elementwise(True), nn.Dropout2d: elementwise(True),
    nn.Dropout3d: elementwise(True), nn.AlphaDropout: elementwise(True),
    nn.LayerNorm: normalize_last(1, ""), nn.RMSNorm: normalize_last(1, ""),
    nn.GroupNorm: per_sample(1), nn.InstanceNorm1d: per_sample(2), nn.InstanceNorm2d: per_sample(2),
    nn.InstanceNorm3d: per_sample(2),
    nn.BatchNorm1d: identity, nn.BatchNorm2d: identity, nn.BatchNorm3d: identity,  # see batch_norm
    nn.Conv1d: per_sample(1), nn.Conv2d: per_sample(1), nn.Conv3d: per_sample(1),
    nn.ConvTranspose1d: per_sample(1), nn.ConvTranspose2d: per_sample(1),
    nn.MaxPool1d: per_sample(1), nn.MaxPool2d: per_sample(1), nn.AvgPool1d: per_sample(1),
    nn.AvgPool2d: per_sample(1), nn.AdaptiveAvgPool1d: per_sample(1),
    nn.AdaptiveAvgPool2d: per_sample(1), nn.Upsample: per_sample(1),
    nn.Flatten: reshape, nn.Unflatten: reshape,
    nn.CrossEntropyLoss: class_loss, nn.NLLLoss: class_loss,
    nn.RNN: rnn, nn.LSTM: rnn, nn.GRU: rnn, nn.MultiheadAttention: multihead_attention,
}
MODULE_RULES.update({m: elementwise(False) for m in _ACTIVATION_MODULES})
for _m in (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss, nn.BCEWithLogitsLoss,
           nn.KLDivLoss, nn.SoftMarginLoss, nn.PoissonNLLLoss, nn.GaussianNLLLoss,
           nn.HingeEmbeddingLoss, nn.MarginRankingLoss, nn.MultiLabelSoftMarginLoss):
    MODULE_RULES[_m] = pointwise_loss


for _m in (nn.Softmax, nn.LogSoftmax, nn.Softmin):  # dim from the module (None: torch's legacy rule)
    MODULE_RULES[_m] = lambda ctx: along(99, ctx.module.dim)(ctx)


def rows_of(ctx: Ctx):
    """The node's value as Rows (or a tuple / Each of them), by its op's rule."""
    node = ctx.node
    if node.op == "call_module":
        rule = MODULE_RULES.get(type(ctx.module), default)
    elif node.op in ("call_function", "call_method"):
        rule = RULES.get(_name(ctx), default)
        if node.target is operator.matmul:
            rule = matmul
    else:
        return None
    return rule(ctx)
