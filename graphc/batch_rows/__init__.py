"""Where a traced value holds the batch's rows: the abstract values find_batch_dims propagates.

Every input's dim 0 starts as a row symbol of its own. A value's `Rows` says, per dim,
which symbol that dim indexes (None: not a row dim) and which symbols were summed or
averaged into it (`reduced`: a batch mean is linear in the rows, so micro-batches can
compute parts of it). Op rules (rules.py: the table; shapes.py, layers.py: the rules;
context.py: what a rule sees) move symbols through ops, unify the symbols an
op lines up (x + y, cross_entropy's input rows and target rows) and report a Coupling
where an op mixes rows (a softmax over a row dim, a row-by-row product, a batch mean used
nonlinearly): per micro-batch such an op would compute something else, unless the
sums it combines have no gradient (WholeSums: a router's token counts), which the whole
batch then gives every micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, Optional, Tuple


@dataclass(frozen=True)
class Rows:
    """One tensor: the row symbol of each dim, the symbols reduced into it, and whether it
    is `torch.arange(n)` (a position index, which lines up with any row dim of size n), or,
    with `repeats` k, `torch.arange(n).repeat_interleave(k)` (each position k times in a row)."""

    dims: Tuple[Optional[int], ...]
    reduced: FrozenSet[int] = frozenset()
    position: bool = False
    repeats: int = 1

    @property
    def symbols(self) -> FrozenSet[int]:
        return frozenset(d for d in self.dims if d is not None)

    @staticmethod
    def none(ndim: int) -> "Rows":
        return Rows((None,) * ndim)


@dataclass(frozen=True)
class Each:
    """A sequence of tensors laid out alike (chunk, split, unbind, an RNN's states)."""

    item: Rows


@dataclass(frozen=True)
class Coupling:
    """An op at `node` that mixes the rows of `symbols` (with `meets`: only where a symbol
    of `symbols` and one of `meets` turn out to be the same rows)."""

    node: object
    why: str
    symbols: FrozenSet[int]
    meets: Optional[FrozenSet[int]] = None


@dataclass(frozen=True)
class WholeSums:
    """An op at `node` that combines batch sums nonlinearly, exact per micro-batch when each
    of `counts` (inputs without gradient, reduced over the rows of `symbols`) takes the whole
    batch's value (NOTE: Whole-batch sums, graphc/passes/feed_whole_sums.py)."""

    node: object
    counts: Tuple[object, ...]
    symbols: FrozenSet[int]


class Symbols:
    """Union-find over row symbols: two symbols an op lines up are the same rows."""

    def __init__(self):
        self.parent: Dict[int, int] = {}

    def new(self) -> int:
        s = len(self.parent)
        self.parent[s] = s
        return s

    def find(self, s: int) -> int:
        while self.parent[s] != s:
            self.parent[s] = self.parent[self.parent[s]]
            s = self.parent[s]
        return s

    def union(self, a: Optional[int], b: Optional[int]) -> None:
        if a is not None and b is not None:
            ra, rb = self.find(a), self.find(b)
            if ra != rb:
                self.parent[max(ra, rb)] = min(ra, rb)

    def classes(self, symbols: Iterable[int]) -> FrozenSet[int]:
        return frozenset(self.find(s) for s in symbols)
