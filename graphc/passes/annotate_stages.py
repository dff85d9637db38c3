"""annotate_stages: gives every node of the traced graph a pipeline stage.

Invariant: every node has node.meta[META_STAGE] (an index into the graph's stages, as
stage_of_module and place_by_layout number them) and META_STAGE_WHY naming the rule that
set it. The rules, in order:
  0. placement - without set_stage, a node place_by_layout placed keeps its stage (See
               NOTE: Stages from placements);
  1. module  - a node inside (or calling) a module configured with set_stage takes the
               innermost such module's stage;
  2. forward - any other node with staged inputs takes the latest of its inputs' stages
               (data flows forward, so e.g. the loss runs on the last stage);
  3. users   - a node with no staged input (a placeholder, a constant, a factory call)
               runs on the earliest stage among its users (an input placed on the ranks
               of several stages, place_inputs: the latest of those at or before it);
  4. default - whatever is left (no set_stage at all) runs on stage 0.
A module called on two stages (shared) takes its caller's stage at each call, and a
parameter or buffer read on several stages is one get_attr node per stage: every stage
that uses a parameter holds it (tied parameters, see insert_tie_sync).
Requires: trace_build (and place_by_layout without set_stage); stage_of_module maps
configured qualified names to stages.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch.fx as fx

from ..meta import META_INPUT_STAGES, META_STAGE, META_STAGE_WHY, is_backward


def annotate_stages(gm: fx.GraphModule, stage_of_module: Dict[str, int]) -> fx.GraphModule:
    nodes = list(gm.graph.nodes)
    for node in nodes:
        if META_STAGE in node.meta:  # placed by place_by_layout
            continue
        stage = _module_stage(node, stage_of_module)
        if stage is not None:
            _set(node, stage, "module")
        elif node.op not in ("placeholder", "output") and not is_backward(node):
            staged = [a.meta[META_STAGE] for a in node.all_input_nodes if META_STAGE in a.meta]
            if staged:
                _set(node, max(staged), "forward")
    for node in reversed(nodes):
        if META_STAGE not in node.meta and node.op != "output" and not is_backward(node):
            users = [u.meta[META_STAGE] for u in node.users if META_STAGE in u.meta]
            if users and META_INPUT_STAGES in node.meta:   # an input on a placement of several stages
                held = [s for s in node.meta[META_INPUT_STAGES] if s <= min(users)]
                _set(node, max(held) if held else min(node.meta[META_INPUT_STAGES]), "input")
            elif users:
                _set(node, min(users), "users")
    # a node with no staged inputs may have got a stage from its users only now
    for node in nodes:
        if META_STAGE not in node.meta and node.op not in ("output",) and not is_backward(node):
            staged = [a.meta[META_STAGE] for a in node.all_input_nodes if META_STAGE in a.meta]
            _set(node, max(staged) if staged else 0, "forward" if staged else "default")
        if is_backward(node):
            _set(node, node.args[0].meta[META_STAGE], "loss")
    _one_read_per_stage(gm)
    gm.recompile()
    return gm


def _set(node: fx.Node, stage: int, why: str) -> None:
    node.meta[META_STAGE] = stage
    node.meta[META_STAGE_WHY] = why


def _innermost(path: str, stage_of_module: Dict[str, int]) -> Optional[int]:
    """Stage of the longest configured prefix of a dotted module path."""
    parts = path.split(".")
    for k in range(len(parts), 0, -1):
        prefix = ".".join(parts[:k])
        if prefix in stage_of_module:
            return stage_of_module[prefix]
    return None


def _module_stage(node: fx.Node, stage_of_module: Dict[str, int]) -> Optional[int]:
    if node.op == "get_attr":
        stage = _innermost(str(node.target), stage_of_module)
        if stage is not None:
            return stage
    return _innermost_in_chain(_call_chain(node), stage_of_module)


def _call_chain(node: fx.Node) -> List[str]:
    """Qualified names of the modules `node` was traced in, outermost first (a call_module
    node's own module last)."""
    stack = node.meta.get("nn_module_stack") or {}
    chain = [v[0] if isinstance(v, tuple) else k.split("@")[0] for k, v in stack.items()]
    if node.op == "call_module" and (not chain or chain[-1] != str(node.target)):
        chain.append(str(node.target))
    return chain


def _innermost_in_chain(chain: List[str], stage_of_module: Dict[str, int]) -> Optional[int]:
    """Stage of the innermost configured module that the call went through.

    Each module is looked up by its path and, up to its caller, by the containers on that
    path (a configured ModuleList). A module called from outside its own path (one module
    shared by two stages: it has one path, but its second caller is elsewhere) is found by
    its own path only, so each call takes its caller's stage.
    """
    for i in range(len(chain) - 1, -1, -1):
        parts, caller = chain[i].split("."), chain[i - 1] if i else ""
        for k in range(len(parts), 0, -1):
            prefix = ".".join(parts[:k])
            if k < len(parts) and caller and not prefix.startswith(caller + "."):
                break
            if prefix in stage_of_module:
                return stage_of_module[prefix]
    return None


def _one_read_per_stage(gm: fx.GraphModule) -> None:
    """A parameter (or buffer) read on several stages gets one get_attr node per stage, so
    each of those stages holds it instead of receiving it every micro-batch. See NOTE: Tied
    parameters (graphc/passes/insert_tie_sync.py)."""
    for node in [n for n in gm.graph.nodes if n.op == "get_attr"]:
        by_stage: Dict[int, List[fx.Node]] = {}
        for user in node.users:
            if user.op != "output" and not is_backward(user):
                by_stage.setdefault(user.meta[META_STAGE], []).append(user)
        if not by_stage:
            continue
        if node.meta[META_STAGE] not in by_stage:  # read only elsewhere: move it there
            _set(node, min(by_stage), "users")
        for stage, users in sorted(by_stage.items()):
            if stage == node.meta[META_STAGE]:
                continue
            with gm.graph.inserting_after(node):
                copy = gm.graph.get_attr(node.target)
            copy.meta.update(node.meta)
            _set(copy, stage, "users")
            for user in users:
                user.replace_input_with(node, copy)
