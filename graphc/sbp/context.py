"""What an SBP rule sees of one op (RuleCtx) and what it returns (Candidate): shared by the
rule modules (rules.py, routing.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch.fx as fx

from ..meta import META_TENSOR, TensorMeta

Candidate = Tuple[Dict[fx.Node, object], object]


@dataclass
class RuleCtx:
    node: fx.Node
    n: int                          # ranks on this mesh axis
    prod: Dict[fx.Node, object]     # each input's producer SBP on this axis

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
