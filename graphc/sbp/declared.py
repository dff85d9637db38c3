"""What the user declared with to_global, as the compiler reads it.

- `DeclaredLayouts`: the Layout (placement, sbp) of each of a Graph's parameters and buffers that
  `to_global` declared, by every qualified name it has (a tied weight under each of its
  names). The Graph takes this snapshot when it compiles (`Graph.declared_layouts()`, the
  `declared_layouts` step of compile()); it lives on the traced graph
  (`gm.meta[META_DECLARED]`) and dies with it, and the passes read it from there.
- `to_global_op`: the traced form of a `to_global` inside build(), a conversion point that
  `conversion_target` decodes and insert_boxing lowers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

from ..placement import Broadcast, Layout, PartialSum, Split
from ..placement import placement as Placement
from .layout import fmt

META_DECLARED = "graphc_declared"   # gm.meta: DeclaredLayouts of the Graph's parameters and buffers

@dataclass(frozen=True)
class DeclaredLayouts:
    """Qualified parameter or buffer name -> its declared Layout; names absent were never
    declared (the passes treat them as broadcast where they run)."""

    by_name: Dict[str, Layout] = field(default_factory=dict)

    def __post_init__(self):
        # a (placement, sbp) pair given by hand (tests) is read as the Layout it names
        object.__setattr__(self, "by_name", {k: Layout.of(v) for k, v in self.by_name.items()})

    def of(self, name: str) -> Optional[Layout]:
        return self.by_name.get(name)

    def placements(self) -> List[Placement]:
        return [layout.placement for layout in self.by_name.values()]

    def __str__(self) -> str:
        if not self.by_name:
            return "no parameter or buffer declared with to_global"
        return "\n".join(f"{name}: {fmt(layout.sbp)} on {layout.placement}"
                         for name, layout in self.by_name.items())


def declared_in(gm) -> DeclaredLayouts:
    """The snapshot compile() put on the traced graph (none declared if it has none)."""
    return gm.meta.get(META_DECLARED) or DeclaredLayouts()


def to_global_op(t, placement: tuple, sbp: tuple):
    """The traced form of to_global inside build(); lowered by the compiler (insert_boxing).

    placement is (type, ranks); sbp holds one code per mesh axis (see conversion_target).
    """
    return t


def encode_sbp(sbp: Iterable) -> tuple:
    """SBP values as plain ints for to_global_op's kwargs (fx would turn dataclass arguments
    into constructor nodes): dim d for split(d), -1 broadcast, -2 partial_sum."""
    return tuple(s.dim if isinstance(s, Split) else (-1 if isinstance(s, Broadcast) else -2) for s in sbp)


def conversion_target(node) -> Layout:
    """The Layout a traced to_global_op node converts to."""
    kind, ranks = node.kwargs["placement"]
    decode = {-1: Broadcast(), -2: PartialSum()}
    return Layout(Placement(kind, ranks), tuple(decode.get(c) or Split(c) for c in node.kwargs["sbp"]))
