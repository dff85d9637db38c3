"""list_collectives: makes every SBP conversion's collectives visible in the plans.

Invariant: after each forward (backward) of a stage, the plan lists a Collective for
every communicating conversion that compute issues: kind, conversion node, SBP before
and after, this rank's group, the dtype that travels (the value's: autocast's where it ran
under it, and its gradient's in the backward alike) and the bytes it sends. Local
conversions (slices, zero fills) move nothing and are not listed. An expert-parallel layer
lists its exchanges, 3 forward and 2 backward (See NOTE: Expert parallel). A pre-pass (PrePass,
NOTE: Whole-batch sums) lists its cut program's forward conversions likewise (`0P1.ALL_TO_ALL`).
The runtime runs them inside the compute.
Requires: split_stages, lower_plan (programs hold the box nodes insert_boxing made).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from ..meta import META_BOXING, META_SBP, META_TENSOR
from ..ops.context_parallel import context_parallel_attention
from ..ops.expert_capacity import capacity_of
from ..ops.experts import EXCHANGES, GRAD_EXCHANGES, expert_parallel
from ..placement import Broadcast, PartialSum
from ..plan.instructions import ACT, GRAD, PRE, Backward, Collective, Forward, Instruction, PrePass
from ..plan.plan import ExecutionPlan
from ..plan.program import StageProgram
from ..sbp.boxing import BOXINGS, backward_collective
from ..sbp.context_parallel import exchanges
from ..sbp.cost import moved_bytes, tensor_bytes
from ..sbp.layout import fmt


def list_collectives(plans: Sequence[ExecutionPlan], programs: Sequence[StageProgram]) -> List[ExecutionPlan]:
    """Ranks of one stage list the same conversions; each member of a group gets the same
    Collective objects (one per conversion and micro-batch), so a thousand-rank plan holds
    each collective once per group, not once per rank."""
    conversions = {(prog.stage, kind): _conversions(prog.module, kind is not Backward)
                   for prog in programs for kind in (Forward, Backward)}
    conversions.update({(prog.stage, PrePass): _conversions(prog.prologue.module, True)
                        for prog in programs if prog.prologue is not None and prog.prologue.in_plan})
    shared: Dict[tuple, Collective] = {}
    for plan in plans:
        mine: Dict[tuple, list] = {}   # (stage, forward) -> its conversions with this rank's group
        out: List[Instruction] = []
        for ins in plan.instructions:
            out.append(ins)
            if isinstance(ins, (Forward, Backward, PrePass)):
                key = (ins.stage, type(ins))
                if key not in mine:
                    mine[key] = _with_group(conversions[key], plan.rank)
                out += _collectives(mine[key], ins, shared)
        plan.instructions[:] = out
    return list(plans)


def _with_group(conversions: List["_Conversion"], rank: int) -> List[tuple]:
    """(conversion, this rank's group) for the conversions this rank takes part in."""
    found = []
    for c in conversions:
        group = next((g for g in c.groups if rank in g), ())
        if group:
            found.append((c, group))
    return found


@dataclass(frozen=True)
class _Conversion:
    """One communicating conversion of a stage, in the order its forward (backward) runs it."""

    kind: str
    groups: Tuple[Tuple[int, ...], ...]
    node: str
    sbp_in: str
    sbp_out: str
    nbytes: int                 # bytes each rank sends, for a group of len(groups[0]) ranks
    note: str
    dtype: str                  # the value's (its gradient's in the backward: the same dtype)
    sent: int = -1              # bytes a rank sends, where known directly (attention's exchanges)


def _conversions(module, forward: bool) -> List[_Conversion]:
    """A stage program's (or its prologue's) communicating conversions, in the order its
    forward (backward) runs them."""
    nodes = [n for n in module.graph.nodes if META_BOXING in n.meta or _exchanging(n)]
    found = []
    for node in (nodes if forward else reversed(nodes)):
        if node.target is expert_parallel:
            found += _expert_exchanges(node, forward)
            continue
        if META_BOXING not in node.meta:
            found += _attention_exchanges(node, forward)
            continue
        info = node.meta[META_BOXING]
        meta = node.meta[META_TENSOR]
        kind = BOXINGS[info.kind].collective if forward else \
            (backward_collective(info.kind) if meta.requires_grad else None)
        groups = tuple(tuple(g) for g in info.groups if len(g) > 1)
        if kind is None or not groups:
            continue
        before, after = (fmt(info.src), fmt(info.dst)) if forward else _gradient_sbp(info)
        found.append(_Conversion(kind, groups, node.name, before, after,
                                 tensor_bytes(meta), info.note, meta.dtype))
    return found


def _exchanging(node) -> bool:
    """Does the node exchange inside: attention over a split sequence (NOTE: Context parallel)
    or experts split over ranks (NOTE: Expert parallel)?"""
    return node.op == "call_function" and node.target in (context_parallel_attention, expert_parallel)


def _attention_exchanges(node, forward: bool) -> List[_Conversion]:
    """The exchanges of one context-parallel attention call, in the order it makes them."""
    groups = tuple(tuple(g) for g in node.args[4] if len(g) > 1)
    if not groups or not (forward or node.meta[META_TENSOR].requires_grad):
        return []
    sbp = fmt(node.meta[META_SBP].out)
    dtype = node.meta[META_TENSOR].dtype
    return [_Conversion(kind, groups, node.name, sbp, sbp, 0, note, dtype, sent)
            for kind, sent, note in exchanges(node, forward, len(groups[0]))]


def _expert_exchanges(node, forward: bool) -> List[_Conversion]:
    """The all-to-alls of one expert-parallel layer, in the order it runs them (See NOTE:
    Expert parallel): bytes are the balanced estimate, each rank's share of its pairs
    leaving it (the real sizes are the routing's, exchanged first as counts)."""
    hidden, index = node.args[0].meta[META_TENSOR], node.args[1].meta[META_TENSOR]
    groups = tuple(tuple(g) for g in node.kwargs["groups"] if len(g) > 1)
    if not groups or (not forward and not node.meta[META_TENSOR].requires_grad):
        return []
    n, experts, layer = len(groups[0]), node.kwargs["num_experts"], _layer_of(node)
    pairs = tensor_bytes(hidden) * index.shape[-1]
    sizes = {"counts": experts * 8 * n, "tokens": pairs, "back": pairs}
    capacity, fixed = node.kwargs.get("capacity"), ""
    if capacity is not None:   # fixed rows, no counts first (NOTE: Expert capacity)
        rows = index.shape[0] * index.shape[-1]
        sizes["tokens"] = sizes["back"] = pairs // rows * experts * capacity_of(rows, experts, capacity)
        fixed = f" (capacity {capacity:g})"
    return [_Conversion("all_to_all", groups, node.name, before, after, sizes[what],
                        f"expert parallel {layer}: {what}{fixed}", "int64" if what == "counts" else hidden.dtype)
            for what, before, after in (EXCHANGES if forward else GRAD_EXCHANGES)
            if not (fixed and what == "counts")]


def _layer_of(node) -> str:
    """The experts module's qualified name (its weight's get_attr target without the weight)."""
    gate_up = node.args[3]
    return gate_up.target.rsplit(".", 1)[0] if gate_up.op == "get_attr" else gate_up.name


_DIRECTION = {Forward: ACT, Backward: GRAD, PrePass: PRE}


def _collectives(conversions: List[tuple], ins, shared: dict) -> List[Collective]:
    found = []
    for c, group in conversions:
        key = (ins, c.node, group, c.note)   # an expert layer: several per node
        if key not in shared:
            shared[key] = Collective(c.kind, ins.stage, ins.microbatch, _DIRECTION[type(ins)],
                                     group, c.node, c.sbp_in, c.sbp_out,
                                     c.sent if c.sent >= 0 else moved_bytes(c.kind, c.nbytes, len(group)),
                                     c.note, c.dtype)
        found.append(shared[key])
    return found


def _gradient_sbp(info) -> tuple:
    """(before, after) SBP of the gradient a conversion's backward converts, written grad:...

    See NOTE: gradient layouts (docs/sbp.md): a gradient is split like its value, and whole
    where the value is broadcast or partial_sum; a grad_all_reduce (or gather_scatter)
    receives it partial.
    """
    def whole(sbp):
        return tuple(Broadcast() if isinstance(s, PartialSum) else s for s in sbp)
    incoming = whole(info.dst)
    if BOXINGS[info.kind].partial_grad:
        incoming = incoming[:info.axis] + (PartialSum(),) + incoming[info.axis + 1:]
    return "grad:" + fmt(incoming), "grad:" + fmt(whole(info.src))
