"""place_by_layout: without set_stage, every op runs where its inputs and parameters are placed.

Invariant: every node the program places has META_PLACEMENT and META_STAGE (why
"placement"), and gm.meta[META_FOUND_STAGES] holds one FoundStage per distinct placement,
in data-flow order (values flow only from a stage to a later one). The rules are OneFlow's
for global tensors:
  1. own     - an input GlobalTensor, a parameter or buffer declared with to_global, and a
               to_global() inside build() are where they say; a module call is where its
               declared parameters and buffers are;
  2. inputs  - any other op runs where its placed inputs are. Inputs on two placements are
               an error: a value changes placement only at to_global.
What nothing places (plain tensor inputs, undeclared parameters, constants) is left to
annotate_stages, which puts it with its users or inputs, as it does under set_stage.
Requires: trace_build; no module configured with set_stage (compile() runs it only then).

NOTE: Stages from placements. Each distinct placement (device type and set of ranks) is one
pipeline stage. From here on the compiler treats the stages found exactly as stages given
by set_stage (collect_placed_stages checks them the same way), so with accumulation the
program pipelines as if the user had written one set_stage per placement. Placements that
share some ranks but not all cannot be stages, and a value sent back to an earlier
placement would make the stages a cycle; both are refused here, naming what was placed.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ..errors import GraphcError
from ..meta import (META_FOUND_STAGES, META_PLACEMENT, META_STAGE, META_STAGE_WHY, FoundStage,
                    is_backward)
from ..sbp.declared import conversion_target, declared_in, to_global_op
from .user_lines import node_line

# where a node is placed, and what placed it there (for messages): (placement, source)
Claim = Tuple[object, str]


def place_by_layout(gm: fx.GraphModule, input_layouts: Sequence = ()) -> fx.GraphModule:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    given = {n: layout.placement for n, layout in zip(placeholders, input_layouts) if layout}
    placed: Dict[fx.Node, Claim] = {}
    for node in gm.graph.nodes:
        if node.op == "output" or is_backward(node):
            continue
        claim = _own_claim(gm, node, given)
        if claim is None or node.op == "call_module":  # a module's inputs must agree with it
            held = [(_what(a, placed[a]), placed[a]) for a in node.all_input_nodes if a in placed]
            agreed = _agreed(node, held + ([(f"its {claim[1]}", claim)] if claim else []))
            claim = claim or agreed
        if claim is not None:
            placed[node] = claim
    found = _stages_in_data_flow_order(placed)
    index = {_key(f.placement): i for i, f in enumerate(found)}
    for node, (where, _) in placed.items():
        node.meta[META_PLACEMENT] = where
        node.meta[META_STAGE] = index[_key(where)]
        node.meta[META_STAGE_WHY] = "placement"
    gm.meta[META_FOUND_STAGES] = tuple(found)
    return gm


def found_stages(gm: fx.GraphModule) -> Tuple[FoundStage, ...]:
    """The stages place_by_layout found (none when the program names no placement)."""
    return gm.meta.get(META_FOUND_STAGES, ())


def _key(where) -> tuple:
    """Placements with the same device type and ranks run as one stage (a 2-D placement and
    a 1-D one over the same ranks included: the stage's mesh is then the 2-D one)."""
    return where.type, frozenset(where.flat_ranks)


def _own_claim(gm: fx.GraphModule, node: fx.Node, given: Dict[fx.Node, object]) -> Optional[Claim]:
    """Rule 1: where the program itself puts this node, if it does."""
    if node.op == "placeholder":
        return (given[node], f"input {node.name}") if node in given else None
    if node.op == "call_function" and node.target is to_global_op:
        return conversion_target(node).placement, f"to_global at {node.name}"
    if node.op == "get_attr":
        t = _fetch(gm, str(node.target))
        layout = declared_in(gm).of(str(node.target)) if isinstance(t, torch.Tensor) else None
        return (layout.placement, f"parameter {node.target}") if layout else None
    if node.op == "call_module":
        return _module_claim(gm, node)
    return None


def _module_claim(gm: fx.GraphModule, node: fx.Node) -> Optional[Claim]:
    """A module's call runs where its declared parameters and buffers are: all in one place."""
    mod = gm.get_submodule(str(node.target))
    declared = declared_in(gm)
    claims = [(layout.placement, f"parameter {node.target}.{name}") for name, _ in
              list(mod.named_parameters()) + list(mod.named_buffers())
              for layout in [declared.of(f"{node.target}.{name}")] if layout]
    for where, source in claims[1:]:
        if _key(where) != _key(claims[0][0]):
            raise GraphcError(
                f"module '{node.target}' ({type(mod).__name__}) has {claims[0][1]} on "
                f"{claims[0][0]} and {source} on {where}; without set_stage a module runs where "
                "its parameters and buffers are, so they must share one placement. Fix: declare "
                f"them on one placement, e.g. graphc.to_global(module, placement={where}, sbp=...).")
    return claims[0] if claims else None


def _agreed(node: fx.Node, held: List[Tuple[str, Claim]]) -> Optional[Claim]:
    """Rule 2: the one placement all of a node's placed inputs (and its module) agree on.
    `held`: (what the value is, its claim) per placed input."""
    for what, claim in held[1:]:
        if _key(claim[0]) != _key(held[0][1][0]):
            raise _disagree(node, held[0], (what, claim))
    return held[0][1] if held else None


def _what(value: fx.Node, claim: Claim) -> str:
    """A placed input, as a message names it: by its own name, and by what placed it."""
    if value.op in ("placeholder", "get_attr") or value.target is to_global_op:
        return claim[1]
    return f"'{value.name}' (placed by {claim[1]})"


def _disagree(node: fx.Node, a: Tuple[str, Claim], b: Tuple[str, Claim]) -> GraphcError:
    if _is_parameter(a[0]) and not _is_parameter(b[0]):  # parameters stay; values move
        a, b = b, a
    (a_what, (a_where, _)), (b_what, (b_where, _)) = a, b
    ranks = [list(r) if isinstance(r, tuple) else r for r in b_where.ranks]
    op = f"module '{node.target}'" if node.op == "call_module" else f"'{node.name}'"
    return GraphcError(
        f"{op} at {node_line(node)} reads {a_what} on {a_where} and {b_what} on {b_where}. "
        "Without set_stage an op runs where its inputs and parameters are placed, and a value "
        "moves to another placement only where build() calls graphc.to_global. Fix: move "
        f"{a_what.split(' (')[0]} to ranks {ranks} before this op, with graphc.to_global(value, "
        f"placement=graphc.placement(\"{b_where.type}\", ranks={ranks}), sbp=graphc.sbp.broadcast) "
        "(or the sbp the op needs), or declare both on one placement.")


def _is_parameter(what: str) -> bool:
    return what.startswith(("parameter ", "its parameter "))


def _stages_in_data_flow_order(placed: Dict[fx.Node, Claim]) -> List[FoundStage]:
    """One FoundStage per distinct placement, ordered so that values flow forward; ties (no
    value between two placements) keep the order the program first placed them in."""
    first: Dict[tuple, object] = {}
    sources: Dict[tuple, List[str]] = {}
    after: Dict[tuple, set] = {}   # placement -> placements it sends values to
    for node, (where, source) in placed.items():
        k = _key(where)
        first.setdefault(k, where)
        if source not in sources.setdefault(k, []):
            sources[k].append(source)
        for a in node.all_input_nodes:
            if a in placed and _key(placed[a][0]) != k:
                after.setdefault(_key(placed[a][0]), set()).add(k)
    _check_disjoint(first, sources)
    order = _topological(list(first), after, first, sources)
    return [FoundStage(first[k], tuple(sources[k])) for k in order]


def _check_disjoint(first: Dict[tuple, object], sources: Dict[tuple, List[str]]) -> None:
    keys = list(first)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            shared = sorted(a[1] & b[1])
            if shared:
                raise GraphcError(
                    f"{first[a]} (from {sources[a][0]}) and {first[b]} (from {sources[b][0]}) "
                    f"share rank(s) {shared} without being the same ranks. Without set_stage each "
                    "placement runs as one pipeline stage, and a rank runs one stage. Fix: use the "
                    "same ranks for both, or disjoint ones (See NOTE: Stages from placements).")


def _topological(keys: List[tuple], after: Dict[tuple, set], first, sources) -> List[tuple]:
    """Kahn's order over placements; among the ready ones, the one placed first."""
    waiting = {k: sum(k in after.get(j, ()) for j in keys) for k in keys}
    order: List[tuple] = []
    while len(order) < len(keys):
        ready = [k for k in keys if waiting[k] == 0 and k not in order]
        if not ready:
            cycle = [k for k in keys if k not in order]
            raise GraphcError(
                "build() moves values between " + " and ".join(
                    f"{first[k]} (from {sources[k][0]})" for k in cycle) +
                " in both directions. Without set_stage each placement runs as one pipeline "
                "stage and values flow only from a stage to a later one. Fix: compute what goes "
                "back on a placement of its own ranks, or keep it on the later placement "
                "(See NOTE: Stages from placements).")
        order.append(ready[0])
        for k in after.get(ready[0], ()):
            waiting[k] -= 1
    return order


def _fetch(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
