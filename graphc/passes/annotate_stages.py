"""annotate_stages: gives every node of the traced graph a pipeline stage.

Invariant: every node has node.meta[META_STAGE] (an index into ctx.stages) and
META_STAGE_WHY naming the rule that set it. The rules, in order:
  1. module  - a node inside (or calling) a module configured with set_stage takes the
               innermost such module's stage;
  2. forward - any other node with staged inputs takes the latest of its inputs' stages
               (data flows forward, so e.g. the loss runs on the last stage);
  3. users   - a node with no staged input (a placeholder, a constant, a factory call)
               runs on the earliest stage among its users;
  4. default - whatever is left (no set_stage at all) runs on stage 0.
Requires: trace_build; ctx.stage_of_module maps configured qualified names to stages.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch.fx as fx

from ..meta import BACKWARD_TARGET, META_STAGE, META_STAGE_WHY


def annotate_stages(gm: fx.GraphModule, stage_of_module: Dict[str, int]) -> fx.GraphModule:
    nodes = list(gm.graph.nodes)
    for node in nodes:
        stage = _module_stage(node, stage_of_module)
        if stage is not None:
            _set(node, stage, "module")
        elif node.op not in ("placeholder", "output") and not _is_backward(node):
            staged = [a.meta[META_STAGE] for a in node.all_input_nodes if META_STAGE in a.meta]
            if staged:
                _set(node, max(staged), "forward")
    for node in reversed(nodes):
        if META_STAGE not in node.meta and node.op != "output" and not _is_backward(node):
            users = [u.meta[META_STAGE] for u in node.users if META_STAGE in u.meta]
            if users:
                _set(node, min(users), "users")
    # a node with no staged inputs may have got a stage from its users only now
    for node in nodes:
        if META_STAGE not in node.meta and node.op not in ("output",) and not _is_backward(node):
            staged = [a.meta[META_STAGE] for a in node.all_input_nodes if META_STAGE in a.meta]
            _set(node, max(staged) if staged else 0, "forward" if staged else "default")
        if _is_backward(node):
            _set(node, node.args[0].meta[META_STAGE], "loss")
    return gm


def _set(node: fx.Node, stage: int, why: str) -> None:
    node.meta[META_STAGE] = stage
    node.meta[META_STAGE_WHY] = why


def _is_backward(node: fx.Node) -> bool:
    return node.op == "call_method" and node.target == BACKWARD_TARGET


def _innermost(path: str, stage_of_module: Dict[str, int]) -> Optional[int]:
    """Stage of the longest configured prefix of a dotted module path."""
    parts = path.split(".")
    for k in range(len(parts), 0, -1):
        prefix = ".".join(parts[:k])
        if prefix in stage_of_module:
            return stage_of_module[prefix]
    return None


def _module_stage(node: fx.Node, stage_of_module: Dict[str, int]) -> Optional[int]:
    if node.op in ("call_module", "get_attr"):
        stage = _innermost(str(node.target), stage_of_module)
        if stage is not None:
            return stage
    stack = node.meta.get("nn_module_stack") or {}
    for path in reversed(list(stack.keys())):
        stage = _innermost(path, stage_of_module)
        if stage is not None:
            return stage
    return None
