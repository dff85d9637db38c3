"""What an SBP rule sees of one op (RuleCtx) and what it returns (Candidate): shared by the
rule modules (rules.py, routing.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch.fx as fx

from ..meta import META_TENSOR, TensorMeta

Candidate = Tuple[Dict[fx.Node, object], object]


@dataclass
class RuleCtx:
    node: fx.Node
    n: int                          # ranks on this mesh axis
    prod: Dict[fx.Node, object]     # each input's producer SBP on this axis
    # the earlier mesh axes' sizes, and what this node's signature chose on them: each
    # input's required SBP and the output's (NOTE: Nested shards)
    outer_sizes: Sequence[int] = ()
    outer_ins: Dict[fx.Node, Sequence[object]] = field(default_factory=dict)
    outer_out: Sequence[object] = ()

    def meta(self, a) -> Optional[TensorMeta]:
        return a.meta.get(META_TENSOR) if isinstance(a, fx.Node) else None

    @property
    def out(self) -> Optional[TensorMeta]:
        return self.node.meta.get(META_TENSOR)

    def arg(self, i: int, name: str, default=None):
        if len(self.node.args) > i:
            return self.node.args[i]
        return self.node.kwargs.get(name, default)

    def tensors(self) -> List[fx.Node]:
        args = list(self.node.args) + list(self.node.kwargs.values())
        return [a for a in args if self.meta(a) is not None]

    def splits(self, size: int) -> bool:
        """Can a dim of `size` be split on this axis? Shards may differ in size (See NOTE:
        Uneven splits, docs/sbp.md), so any dim of at least n."""
        return size >= self.n

    def divisible(self, size: int) -> bool:
        """Equal shards: for local forms that need them (a reshape merging or cutting a split
        dim, grouped-query heads, a parameter stored in pieces)."""
        return size % self.n == 0 and size >= self.n

    def shard_shape(self, a: Optional[fx.Node] = None) -> Optional[Tuple[int, ...]]:
        """The shape of one shard of input `a` (None: the output) as the earlier mesh axes
        cut it: the piece this axis splits further. None where an earlier axis cuts a dim
        unevenly (shards differ by rank: a rule then reasons on the whole shape)."""
        meta = self.out if a is None else self.meta(a)
        chosen = self.outer_out if a is None else self.outer_ins.get(a, ())
        if meta is None:
            return None
        shape = list(meta.shape)
        for n, s in zip(self.outer_sizes, chosen):
            dim = getattr(s, "dim", None)
            if dim is not None:
                if shape[dim] % n:
                    return None
                shape[dim] //= n
        return tuple(shape)


# NOTE: Nested shards
# On a mesh of several axes, SBP is chosen axis by axis (infer_sbp._choose), and a dim split on
# two axes is cut by the first, then each piece by the second (sbp.layout.local_shape). A rule
# whose validity depends on sizes (a reshape merging dims) must judge the second axis on the
# piece the first left, not on the whole value: rows over data ranks and the sequence over
# context ranks, (split(0), split(1)) of [B, T, V], flatten to (split(0), split(0)) of
# [B*T, V] with no exchange when each data rank holds one row, and cannot be re-split by rows
# over the context axis then (1 row in 2). RuleCtx.shard_shape gives that piece.
