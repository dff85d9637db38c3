"""verify_traced / verify_annotated: the checks of the traced and the annotated fx graph.

A failure is a GraphcError naming the node, the user's line where known, and the fix.
"""
from __future__ import annotations

from typing import Dict

import torch.fx as fx

from ..errors import GraphcError
from ..log import warn_user
from ..meta import META_STAGE, META_TENSOR, is_backward
from .user_lines import node_line

_HOST_SYNC = {"item", "tolist", "numpy", "cpu_numpy"}


def host_sync_refused(method: str, where: str) -> GraphcError:
    """A tensor's values asked for in build() (`.item()`, `.tolist()`, `.numpy()`): refused
    after the trace here, or while tracing where the value is used at once (build_tracer)."""
    return GraphcError(
        f"build() calls .{method}() at {where}; inside build() tensors are symbolic, so their values "
        f"are not known while the graph is compiled. Fix: return the tensor from build() and call "
        f".to_local().{method}() on the result.")


def verify_traced(gm: fx.GraphModule) -> None:
    """Checked right after tracing: host syncs and backward() use."""
    backwards = [n for n in gm.graph.nodes if is_backward(n)]
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target in _HOST_SYNC:
            raise host_sync_refused(node.target, node_line(node))
    if len(backwards) > 1:
        raise GraphcError(
            f"build() calls backward() {len(backwards)} times (at {node_line(backwards[1])}); "
            "graphc runs one backward per step. Fix: sum the losses and call backward() once.")
    for node in backwards:
        if len(node.args) > 1 or node.kwargs:
            raise GraphcError(f"backward() at {node_line(node)} takes no arguments in build(); "
                              "graphc scales the loss for gradient accumulation itself")


def warn_unused_parameters(root, gm: fx.GraphModule) -> None:
    """Warns about modules with parameters that build() never uses.

    The rule (docs/errors.md): a module build() calls runs on a stage even without
    set_stage (the forward rule places it after its inputs), so only a parameterised module
    that build() never touches is suspicious: no rank owns it, so it is neither trained
    nor checkpointed. It is a warning, not an error: spare modules are legal, and frozen ones
    (peft's inactive adapters) are not named.
    Every rank compiles the same graph, so warn_user says it once per job, at the user's line.
    """
    used = {id(p) for p in gm.parameters()}
    unused = sorted({name.rsplit(".", 1)[0] for name, p in root.named_parameters()
                     if id(p) not in used and p.requires_grad})   # a frozen one (an inactive adapter) is spare
    if unused:
        warn_user(
            f"graphc: module(s) {unused} of {type(root).__name__[:-len('Build')]} have parameters "
            "but build() never uses them; no rank owns them until a plan uses them (an adapter "
            "switched on, a branch taken after a change), so until then they are neither trained "
            "nor saved by graph.state_dict(). Fix: call them in build(), or do not assign them "
            "to the Graph.")


def verify_annotated(gm: fx.GraphModule, stage_modules: Dict[str, int], num_stages: int) -> None:
    """Checked after stages and shapes are annotated."""
    used_stages = set()
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if META_STAGE not in node.meta:
            raise GraphcError(f"internal: annotate_stages left node '{node.name}' without a stage")
        stage = node.meta[META_STAGE]
        used_stages.add(stage)
        for arg in node.all_input_nodes:
            if arg.meta[META_STAGE] > stage:
                raise GraphcError(
                    f"node '{node.name}' runs on stage {stage} but uses '{arg.name}' computed on "
                    f"the later stage {arg.meta[META_STAGE]} (at {node_line(node)}); values may only "
                    "flow from a stage to a later one. Fix: give the stages ids in the order "
                    "build() calls them.")
        if is_backward(node):
            _check_loss(node)
    for name, stage in stage_modules.items():
        if stage not in used_stages:
            raise GraphcError(
                f"module '{name}' is set to stage {stage} but build() never runs anything on "
                "that stage. Fix: call the module in build(), or remove its set_stage.")


def _check_loss(node: fx.Node) -> None:
    loss = node.args[0]
    meta = loss.meta.get(META_TENSOR)
    if meta is None or meta.shape != ():
        raise GraphcError(
            f"backward() is called on '{loss.name}' with shape {list(meta.shape) if meta else None} "
            f"at {node_line(node)}; it must be a scalar loss. Fix: reduce it first, e.g. "
            "loss.mean() or loss.sum().")
    if not meta.requires_grad:
        raise GraphcError(
            f"backward() is called on '{loss.name}' at {node_line(node)}, which does not depend on any "
            "parameter that requires grad. Fix: check that the loss is computed from the model's output.")
