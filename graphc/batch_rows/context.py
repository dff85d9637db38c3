"""The context an op rule sees: its node's inputs as Rows, shapes, and the symbol table.

Shared helpers of the rules (graphc/batch_rows/shapes.py, layers.py): dims normalised, the
broadcast of row dims (unifying the symbols it lines up), and the reduced symbols of a
combination with the couplings it implies.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch.fx as fx
import torch.nn as nn

from ..meta import META_TENSOR
from . import Coupling, Rows, Symbols, WholeSums


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
        return [r for r in (self.rows(a) for a in input_nodes(self.node)) if r is not None]

    def unify(self, a: Optional[int], b: Optional[int]) -> None:
        self.syms.union(a, b)

    def couple(self, symbols, why: str, meets=None) -> None:
        symbols = frozenset(s for s in symbols if s is not None)
        if symbols:
            self.events.append(Coupling(self.node, why, symbols,
                                        None if meets is None else frozenset(meets)))


def whole_sums_or_couple(ctx: Ctx, why: str, linear_args: Optional[int] = None) -> None:
    """An op combining several batch sums (a product, a division by one): exact per
    micro-batch when at most one of them carries a gradient (it stays linear) and the others
    take the whole batch's value (NOTE: Whole-batch sums); else a Coupling. linear_args: how
    many leading arguments may carry the gradient (a quotient's numerator only); None: any."""
    nodes = [n for n in input_nodes(ctx.node) if (r := ctx.rows(n)) is not None and r.reduced]
    reduced = frozenset().union(*(ctx.rows(n).reduced for n in nodes)) if nodes else frozenset()
    linear = set(input_nodes(ctx.node)[:linear_args] if linear_args is not None else nodes)
    graded = [n for n in nodes if _requires_grad(n)]
    counts = tuple(n for n in nodes if not _requires_grad(n))
    if counts and len(graded) <= 1 and all(n in linear for n in graded):
        ctx.events.append(WholeSums(ctx.node, counts, frozenset().union(*(ctx.rows(n).reduced for n in counts))))
    else:
        ctx.couple(reduced, why)


def _requires_grad(node: fx.Node) -> bool:
    meta = node.meta.get(META_TENSOR)
    return meta is None or meta.requires_grad


def input_nodes(node: fx.Node) -> List[fx.Node]:
    found: List[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n))
    return found


def norm_dim(d, ndim: int) -> int:
    return d + ndim if d < 0 else d


def norm_dims(d, ndim: int) -> List[int]:
    if d is None:
        return list(range(ndim))
    return [norm_dim(x, ndim) for x in (d if isinstance(d, (list, tuple)) else [d])]


def combine_reduced(ctx: Ctx, parts: List[Rows], linear: bool = True):
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


def broadcast_rows(ctx: Ctx, parts: List[Rows]) -> tuple:
    n = max((len(r.dims) for r in parts), default=0)
    out = []
    for k in range(n):
        found = [r.dims[k - n + len(r.dims)] for r in parts if k - n + len(r.dims) >= 0]
        found = [s for s in found if s is not None]
        for s in found[1:]:
            ctx.unify(found[0], s)
        out.append(found[0] if found else None)
    return tuple(out)


def op_name(ctx: Ctx) -> str:
    t = ctx.node.target
    name = t if isinstance(t, str) else getattr(t, "__name__", str(t))
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name.strip("_")


def in_order(idx: Optional[Rows], shape, n: int) -> bool:
    """Is idx a 1-D position index over n rows that holds every row in order, each the same
    number of times (`torch.arange(n)`, `torch.arange(n).repeat_interleave(k)`)? It reads
    (or writes) each row of the batch from (or into) itself, in each micro-batch as in the
    whole batch."""
    return (idx is not None and idx.position and shape is not None and len(shape) == 1
            and shape[0] == n * idx.repeats)
