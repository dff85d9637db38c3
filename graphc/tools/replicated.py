"""How much of each stage runs replicated because an op had no SBP rule: what `graphc plan`
says per stage (stages.txt) and the hub-model tests assert is zero.

NOTE: Replicated compute
On a stage of several ranks an op without an SBP rule gathers its split or partial inputs
and runs whole on every rank (a gathering fallback, infer_sbp.gathering_fallbacks); every
op after it that reads only whole values then runs whole too, the same numbers on every
rank: the batch of a data-parallel stage, or the heads of a tensor-parallel one, computed
n times. The numbers stay right, so only the plan shows it. An op runs replicated when it
is a gathering fallback, or its output is whole on every mesh axis and it reads a value
that runs replicated (conversions in between pass it on while they keep it whole; one
that splits it ends it). Its share of the stage is counted in output elements, a proxy of
its compute that needs no tensors: the replicated ops' elements over every op's. The
fallback collectives are the plan's collectives marked `fallback: <op>` (insert_boxing).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Set

import math
import torch.fx as fx

from ..meta import META_BOXING, META_SBP, META_STAGE, META_TENSOR
from ..passes.infer_sbp import gathering_fallbacks
from ..placement import Broadcast, flat
from ..plan.instructions import Collective


@dataclass(frozen=True)
class Replicated:
    """One stage's replicated share (See NOTE: Replicated compute)."""

    elements: int            # output elements of the ops that run replicated
    total: int               # output elements of every op of the stage
    fallback_collectives: int  # a step's collectives marked `fallback: <op>`, on its first rank

    @property
    def fraction(self) -> float:
        return self.elements / self.total if self.total else 0.0

    def __str__(self) -> str:
        return (f"replicated compute: {100 * self.fraction:.1f}% of its ops' output elements "
                f"(ops after a gathering fallback), {self.fallback_collectives} fallback collective(s) a step")


def replicated_compute(compiled) -> Dict[int, Replicated]:
    """Per stage of several ranks, the share of its ops that runs replicated.

    Args:
        compiled: a CompiledGraph (its annotated graph and plans).
    Returns:
        stage id -> Replicated; stages of one rank are left out (nothing to replicate).
    """
    gm = compiled.gm
    spread = _replicated_nodes(gm)
    out: Dict[int, Replicated] = {}
    for info in compiled.stages:
        if len(info.ranks) < 2:
            continue
        ops = [n for n in gm.graph.nodes if n.meta.get(META_STAGE) == info.stage_id and _computes(n)]
        plan = compiled.plans[info.ranks[0]]
        fallback = sum(1 for i in plan.instructions if isinstance(i, Collective) and i.stage == info.stage_id
                       and i.note.startswith("fallback"))
        out[info.stage_id] = Replicated(sum(_elements(n) for n in ops if n in spread),
                                        sum(_elements(n) for n in ops), fallback)
    return out


def _replicated_nodes(gm: fx.GraphModule) -> Set[fx.Node]:
    """The gathering fallbacks and every whole value computed from them, in graph order."""
    spread: Set[fx.Node] = set(gathering_fallbacks(gm))
    for node in gm.graph.nodes:
        sig = node.meta.get(META_SBP)
        if node in spread or sig is None or node.op in ("placeholder", "get_attr") or len(flat(sig.mesh)) < 2:
            continue
        if all(isinstance(s, Broadcast) for s in sig.out) and any(a in spread for a in node.all_input_nodes):
            spread.add(node)
    return spread


def _computes(node: fx.Node) -> bool:
    """An op of the user's program that makes a tensor (not a conversion graphc inserted)."""
    return (node.op in ("call_function", "call_method", "call_module") and META_BOXING not in node.meta
            and node.meta.get(META_TENSOR) is not None and META_SBP in node.meta)


def _elements(node: fx.Node) -> int:
    return math.prod(node.meta[META_TENSOR].shape)
