"""Activation checkpointing inside compiled stages: recompute in the compiled backward.

NOTE: Recompute in compiled pieces
AOTAutograd's partitioner (the min-cut one Inductor uses) decides which forward values a
compiled piece saves for its backward; a node whose `meta["recompute"]` is
`CheckpointPolicy.MUST_RECOMPUTE` is never saved but recomputed inside the compiled backward,
from what is saved, as torch.utils.checkpoint regions are under torch.compile. fx copies that
tag (and `ac_graph_id`, which region a node belongs to) from the piece's nodes onto the aten
nodes of the joint graph. graphc's two kinds of checkpointing use it:

- a module marked `config.set_activation_checkpointing(True)` (a CheckpointedRegion call in
  the stage program): `inline_checkpoints` puts its body's nodes in the program in its place,
  tagged, one `ac_graph_id` per call, so the piece around it saves what the region reads and
  recomputes the rest in its backward (an op of the region that runs eager, a random one,
  records as eager does: its mask is kept, not drawn again). A region with buffers (running
  statistics, which the eager region restores for its recompute) stays a CheckpointedRegion
  call, run as traced;
- the graph-wide `config.set_activation_checkpointing("always" | "except_last")`: a
  checkpointed micro-batch's forward records autograd under `recompute_in_backward()`, and
  each piece then runs a variant whose every node is tagged (`recompute_variant`): it saves
  only its inputs (the stage's inputs, and the values eager pieces between compiled ones
  give it) and recomputes the rest inside its compiled backward; the executor then has no
  recompute of its own to run (NOTE: Activation checkpointing). A stage with buffers keeps
  the executor's recompute (the compiled pieces' forward again, recording), which restores
  the buffers the forward updated; so does a stage gathered per ZeRO-3 unit, whose plan lists
  the recompute's gathers (NOTE: ZeRO units).

The numbers are those of the forward: the same compiled kernels recompute the same values.
"""
from __future__ import annotations

import contextlib
import operator
from contextvars import ContextVar
from typing import Dict

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..ops.checkpointed_region import CheckpointedRegion

# set around a checkpointed micro-batch's forward; a ContextVar, so that ranks of the local
# world (threads) each see their own
_RECOMPUTING: ContextVar[bool] = ContextVar("graphc_recompute_in_backward", default=False)


@contextlib.contextmanager
def recompute_in_backward(on: bool = True):
    """Compiled pieces called inside save only their inputs and recompute the rest in their
    backward (NOTE: Recompute in compiled pieces)."""
    token = _RECOMPUTING.set(on)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


def recomputing() -> bool:
    return _RECOMPUTING.get()


def recompute_variant(piece: fx.GraphModule) -> fx.GraphModule:
    """`piece` with every compute node tagged for recompute, in one region."""
    graph = fx.Graph()
    out = graph.graph_copy(piece.graph, {})
    graph.output(out)
    for node in graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            _tag(node, 0)
    return fx.GraphModule(piece, graph)


def inline_checkpoints(module: fx.GraphModule) -> fx.GraphModule:
    """`module`, or a copy sharing its attributes in which each CheckpointedRegion call without
    buffers is replaced by its body's nodes, tagged for recompute."""
    regions = [n for n in module.graph.nodes if _inlinable(module, n)]
    if not regions:
        return module
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    bodies: Dict[fx.Node, tuple] = {}
    attrs = _attributes(module, module.graph)
    for node in module.graph.nodes:
        if node in regions:
            body = module.get_submodule(node.target).body
            attrs.update(_attributes(body, body.graph))
            bodies[node] = _inline(graph, body, [env[a] for a in node.args], regions.index(node) + 1)
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in bodies:
            env[node] = bodies[node.args[0]][node.args[1]]
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    used = {n.target for n in graph.nodes if n.op in ("get_attr", "call_module")}
    return fx.GraphModule({t: v for t, v in attrs.items() if t in used}, graph,
                          class_name=type(module).__name__)


def _attributes(module: fx.GraphModule, graph: fx.Graph) -> Dict[str, object]:
    """What the graph's get_attr and call_module nodes name, from `module` (the same objects)."""
    return {n.target: (module.get_submodule(n.target) if n.op == "call_module" else _get(module, n.target))
            for n in graph.nodes if n.op in ("get_attr", "call_module")}


def _get(module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _inlinable(module: fx.GraphModule, node: fx.Node) -> bool:
    if node.op != "call_module":
        return False
    region = module.get_submodule(node.target)
    return isinstance(region, CheckpointedRegion) and not any(True for _ in region.body.buffers())


def _inline(graph: fx.Graph, body: fx.GraphModule, args, region: int) -> tuple:
    """The body's nodes copied into `graph` reading `args`, each tagged; its output values."""
    env: Dict[fx.Node, fx.Node] = {}
    placeholders = iter(args)
    out = ()
    for node in body.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders)
        elif node.op == "output":
            out = tuple(env[v] for v in node.args[0])
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
            if node.op != "get_attr":
                _tag(env[node], region)
    return out


def tagged_for_recompute(piece: fx.GraphModule) -> bool:
    """Whether a node of `piece` is tagged: AOTAutograd's cache keys a graph by its code, which
    the tags are not part of, and would hand back the untagged piece's partition (measured)."""
    return any("recompute" in n.meta for n in piece.graph.nodes)


def _tag(node: fx.Node, region: int) -> None:
    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    node.meta["ac_graph_id"] = region
