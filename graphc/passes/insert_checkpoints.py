"""insert_checkpoints: a module marked `config.set_activation_checkpointing(True)` recomputes
its forward in its backward instead of keeping its activations.

Invariant: in every stage program, the nodes traced inside a checkpointed module (its
calls, as `nn_module_stack` records them) are moved, in order, into one sub-GraphModule
per call, and a single `graphc_checkpoint_<k>` call_module node takes their place: a
`CheckpointedRegion` that runs the sub-program under torch.utils.checkpoint (non-reentrant),
so autograd saves only the region's inputs. The recompute happens inside the stage's
backward, where the executor re-enters the micro-batch's random draw (ops/random_ops.py), and
sees the module's buffers as they were at the forward (NOTE: Activation checkpointing in
runtime/executor.py), so the numbers are those of no checkpointing. A region that
communicates (an SBP conversion inside it whose forward is a collective, or an op that
exchanges inside: context-parallel attention, expert-parallel experts) is refused: its
collectives would run again, unlisted by the plan.
Requires: split_stages (programs), insert_grad_modes.
"""
from __future__ import annotations

import operator
from typing import List, Sequence, Set

import torch.fx as fx

from ..errors import GraphcError
from ..fx_graphs import copy_subgraph
from ..meta import META_BOXING
from ..plan.program import StageProgram
from ..ops.checkpointed_region import CheckpointedRegion
from ..ops.context_parallel import context_parallel_attention
from ..ops.experts import expert_parallel
from ..sbp.boxing import BOXINGS

EXCHANGING = (context_parallel_attention, expert_parallel)   # ops that communicate inside


def insert_checkpoints(programs: Sequence[StageProgram], checkpointed: Set[str]) -> List[StageProgram]:
    if not checkpointed:
        return list(programs)
    for prog in programs:
        regions = _regions(prog.module.graph, checkpointed)
        for k, (name, nodes) in enumerate(regions):
            _outline(prog.module, nodes, name, f"graphc_checkpoint_{k}")
        if regions:
            prog.module.graph.lint()
            prog.module.recompile()
    return list(programs)


def _owner(node: fx.Node, checkpointed: Set[str]):
    """(module, call) of the outermost checkpointed module the node was traced in, or None."""
    stack = node.meta.get("nn_module_stack") or {}
    for key, value in stack.items():
        path = value[0] if isinstance(value, tuple) else key.split("@")[0]
        if path in checkpointed:
            return path, key
    return None


def _regions(graph: fx.Graph, checkpointed: Set[str]):
    """Runs of consecutive nodes of one call of a checkpointed module, in graph order.

    A node a later pass inserted between two nodes of one call (an SBP conversion before
    its consumer: no `nn_module_stack`) belongs to that call: its region does not end there
    (two regions would keep the conversion's output and hide the communication from the
    check below). One inserted at the call's edge stays outside."""
    regions, current, key, name, between = [], [], None, None, []
    for node in graph.nodes:
        owner = _owner(node, checkpointed) if node.op not in ("placeholder", "output") else None
        if owner is not None and current and owner[1] == key:
            current += between + [node]
            between = []
            continue
        if owner is None and current and node.op != "output" and not node.meta.get("nn_module_stack"):
            between.append(node)
            continue
        if current:
            regions.append((name, current))
        between = []
        current, key, name = ([node], owner[1], owner[0]) if owner is not None else ([], None, None)
    if current:
        regions.append((name, current))
    for name, nodes in regions:
        # a conversion whose forward launches a collective (a local one, a slice or
        # to_partial, recomputes like any op; backward collectives run once either way)
        boxed = [n.name for n in nodes if META_BOXING in n.meta
                 and BOXINGS[n.meta[META_BOXING].kind].collective is not None]
        exchanging = [n.name for n in nodes if n.op == "call_function" and n.target in EXCHANGING]
        if boxed or exchanging:
            found = "; ".join(([f"SBP conversions {boxed}"] if boxed else []) +
                              ([f"ops exchanging inside {exchanging}"] if exchanging else []))
            raise GraphcError(
                f"module '{name}' is marked set_activation_checkpointing(True), but its forward "
                f"communicates ({found}); recomputing it would run those "
                "collectives again. Fix: checkpoint a module whose computation is local to "
                "each rank (e.g. the block inside the tensor-parallel layer), or use the "
                "graph-wide config.set_activation_checkpointing(...), which recomputes whole "
                "stages.")
    return regions


def _outline(module: fx.GraphModule, nodes: List[fx.Node], name: str, attr: str) -> None:
    """Moves `nodes` into a CheckpointedRegion called in their place."""
    inside = set(nodes)
    inputs: List[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    region = CheckpointedRegion(copy_subgraph(module, nodes, inputs, outputs), name)
    module.add_submodule(attr, region)
    with module.graph.inserting_before(nodes[0]):
        call = module.graph.call_module(attr, tuple(inputs))
        call.meta.update(nodes[-1].meta)
        for i, o in enumerate(outputs):
            got = module.graph.call_function(operator.getitem, (call, i))
            got.meta = dict(o.meta)
            o.replace_all_uses_with(got)
    for n in reversed(nodes):
        module.graph.erase_node(n)

