"""Rules of products, layers, losses and tensor creation (see graphc/batch_rows/rules.py)."""
from __future__ import annotations

from typing import Dict, List, Optional

from . import Each, Rows
from .context import Ctx, broadcast_rows, combine_reduced, input_nodes, norm_dim, op_name


# -- products and layers ---------------------------------------------------------------------
def _contract(ctx: Ctx, a: Optional[int], b: Optional[int]) -> frozenset:
    """A contraction over a row dim sums a product per row: linear in the rows."""
    ctx.unify(a, b)
    return frozenset(s for s in (a, b) if s is not None)


def _product(ctx: Ctx, parts: List[Rows]) -> frozenset:
    if sum(1 for r in parts if r.reduced) > 1:
        ctx.couple(frozenset().union(*(r.reduced for r in parts)), "two sums or means over the "
                   "batch are multiplied")
    return combine_reduced(ctx, parts)


def matmul(ctx: Ctx):
    a, b = ctx.rows(0), ctx.rows(1)
    return None if a is None or b is None else _matmul_rows(ctx, a, b)


def _matmul_rows(ctx: Ctx, a: Rows, b: Rows) -> Rows:
    ad, bd = a.dims, b.dims
    if len(ad) == 1 and len(bd) == 1:
        summed, out = _contract(ctx, ad[0], bd[0]), ()
    elif len(ad) == 1:
        summed, out = _contract(ctx, ad[0], bd[-2]), bd[:-2] + (bd[-1],)
    elif len(bd) == 1:
        summed, out = _contract(ctx, ad[-1], bd[0]), ad[:-1]
    else:
        summed = _contract(ctx, ad[-1], bd[-2])
        lead = broadcast_rows(ctx, [Rows(ad[:-2]), Rows(bd[:-2])])
        out = lead + (ad[-2], bd[-1])
    return Rows(out, _product(ctx, [a, b]) | summed)


def add_product(ctx: Ctx):
    """addmm / addmv / baddbmm (HF GPT-2's Conv1D: `torch.addmm(bias, x.view(-1, nx), w)`):
    beta * input + alpha * (m1 @ m2), a matmul's rows broadcast with the added input's."""
    x, a, b = ctx.rows(0), ctx.rows(1), ctx.rows(2)
    if x is None or a is None or b is None:
        return None
    product = _matmul_rows(ctx, a, b)
    return Rows(broadcast_rows(ctx, [x, product]), combine_reduced(ctx, [x, product]))


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
    lead = broadcast_rows(ctx, [Rows(q.dims[:-2]), Rows(k.dims[:-2]), Rows(v.dims[:-2])])
    return Rows(lead + (q.dims[-2], v.dims[-1]), combine_reduced(ctx, [q, k, v], linear=False))


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
        dims = broadcast_rows(ctx, [a, b])
        d = norm_dim(ctx.arg(dim_at, "dim", default_dim), len(dims))
        ctx.couple([dims[d]], f"'{op_name(ctx)}' reduces across the batch's rows")
        out = ctx.shape()
        keep = out is not None and len(out) == len(dims)
        return Rows(tuple(s if k != d else None for k, s in enumerate(dims) if keep or k != d),
                    combine_reduced(ctx, [a, b], linear=False))
    return rule


def outer_pairs(ctx: Ctx):
    """cdist / outer: every row of one input against every row of the other."""
    a, b = ctx.rows(0), ctx.rows(1)
    if a is None or b is None:
        return None
    if op_name(ctx) == "outer":
        return Rows((a.dims[0], b.dims[0]), _product(ctx, [a, b]))
    ctx.couple([a.dims[-1], b.dims[-1]], "cdist reduces across the batch's rows")
    lead = broadcast_rows(ctx, [Rows(a.dims[:-2]), Rows(b.dims[:-2])])
    return Rows(lead + (a.dims[-2], b.dims[-2]), combine_reduced(ctx, [a, b], linear=False))


# -- losses -----------------------------------------------------------------------------------
def class_loss(ctx: Ctx):
    """cross_entropy / nll_loss: rows of input and target line up; classes are dim 1."""
    x, y = ctx.rows(0), ctx.rows(1)
    if x is None or y is None:
        return None
    combine_reduced(ctx, [x, y], linear=False)
    if len(x.dims) == 1:
        ctx.couple([x.dims[0]], "the loss's classes are rows of the batch")
        rows: tuple = ()
    elif len(y.dims) == len(x.dims):  # class probabilities as targets
        dims = broadcast_rows(ctx, [x, y])
        ctx.couple([dims[1]], "the loss's classes are rows of the batch")
        rows = dims[:1] + dims[2:]
    else:
        ctx.couple([x.dims[1]], "the loss's softmax runs across rows of the batch (its "
                   "classes are the batch's rows)")
        rows = broadcast_rows(ctx, [Rows(x.dims[:1] + x.dims[2:]), y])
    weight = ctx.rows(2) if ctx.module is None else None
    if weight is not None:
        ctx.couple(weight.dims, "the loss's class weights are rows of the batch")
    return _loss_out(ctx, rows)


def pointwise_loss(ctx: Ctx):
    """mse, l1, bce, kl_div, ...: inputs lined up element by element, then reduced."""
    parts = [r for r in (ctx.rows(a) for a in input_nodes(ctx.node)) if r is not None]
    if not parts:
        return None
    combine_reduced(ctx, parts, linear=False)
    return _loss_out(ctx, broadcast_rows(ctx, parts))


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
    return Rows((None,) * len(out), position=op_name(ctx) == "arange" and start_only and len(out) == 1)


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
    """No rule: rows kept where the output keeps its first input's shape or leading size.

    Rows of the inputs that the output does not keep are reported, and so is a batch mean
    passed through: graphc cannot tell whether the op mixed the rows (torch.cov(x.T) does)
    or is nonlinear in the mean (torch.logdet(z.T @ z) is)."""
    parts = ctx.tensors()
    out = ctx.shape()
    if not parts:
        return Rows.none(len(out)) if out is not None else None
    first = parts[0]
    first_node = next(a for a in input_nodes(ctx.node) if ctx.rows(a) is not None)
    ins = ctx.shape(first_node)
    reduced = frozenset().union(*(r.reduced for r in parts))
    if out is None:
        dims: tuple = ()
    elif ins is not None and tuple(ins) == tuple(out):
        dims = first.dims
    elif ins and out and ins[0] == out[0]:
        dims = (first.dims[0],) + (None,) * (len(out) - 1)
    else:
        dims = (None,) * len(out)
    lost = frozenset().union(*(r.symbols for r in parts)) - set(dims)
    ctx.couple(lost, f"graphc has no rule for '{op_name(ctx)}', whose result does not keep these "
               "rows of the batch apart (it may mix them)")
    ctx.couple(reduced, f"a sum or mean over the batch goes through '{op_name(ctx)}', which "
               "graphc has no rule for (it may be nonlinear)")
    return Rows(dims, reduced) if out is not None else None
