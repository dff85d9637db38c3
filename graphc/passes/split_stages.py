"""split_stages: cuts the annotated graph into one fx program per pipeline stage.

Invariant: stage s's program computes exactly the nodes annotated with stage s; every
value it reads from another stage (or a user input placed on another stage) is one of
its inputs, listed in recv_from under the producing stage; every value a later stage
reads is one of its outputs, listed in send_to under each consuming stage, so a skip
connection goes straight from its producer's stage to its consumer's stage. Every list
of values crossing one boundary (send_to[c] of the sender, recv_from[p] of the receiver,
and so their gradients) is in the annotated graph's node order (see NOTE: Boundary order).
Requires: annotate_stages, propagate_shapes, verify_annotated.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Tuple

import torch.fx as fx

from ..errors import GraphcError
from ..meta import META_ARRIVAL, META_ROWS, META_SBP, META_STAGE, META_TENSOR, is_backward
from ..plan.instructions import TensorSpec
from ..plan.program import StageProgram
from ..sbp.layout import B, flat, is_even, local_shape, mesh_shape, same_shape
from ..sbp.pieces import Reshard


# NOTE: Boundary order
# A sender knows its outputs in the order it produces them, a receiver its inputs in the
# order it first uses them; the two differ as soon as a boundary cuts a residual block
# (`h + fc2(gelu(fc1(h)))` cut after gelu uses gelu before h). Both sides therefore list
# the values crossing a boundary in one canonical order, the node order of the whole
# annotated graph, which every stage (and every rank) sees alike. lower_plan copies these
# lists into Send/Recv payloads, and the runtime moves tensors in payload order.


def split_stages(gm: fx.GraphModule, num_stages: int) -> List[StageProgram]:
    nodes = [n for n in gm.graph.nodes if n.op != "output" and not is_backward(n)]
    backward = next((n for n in gm.graph.nodes if is_backward(n)), None)
    loss = backward.args[0] if backward is not None else None
    output = gm.graph.output_node()
    results = set(output.all_input_nodes)
    arg_index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    meshes = {n.meta[META_STAGE]: n.meta[META_SBP].mesh for n in nodes if n.meta.get(META_SBP)}
    programs = [_stage_program(gm, s, nodes, loss, results, arg_index, meshes)
                for s in range(num_stages)]
    for prog in programs:  # See NOTE: Boundary order
        for specs in list(prog.recv_from.values()) + list(prog.send_to.values()):
            specs.sort(key=lambda spec: order[spec.name])
    return programs


def _spec(node: fx.Node, stage: int, other: int) -> TensorSpec:
    meta = node.meta.get(META_TENSOR)
    if meta is None:
        raise GraphcError(
            f"value '{node.name}' ({node.format_node()}) crosses from stage {stage} to stage "
            f"{other} but is not a tensor; only tensors can be sent between stages. Fix: compute "
            "it on the stage that uses it (e.g. call .size() there).")
    sig = node.meta.get(META_SBP)  # a split value travels as its local shard
    shape = local_shape(meta.shape, sig.out, sig.mesh) if sig else meta.shape
    return TensorSpec(node.name, shape, meta.dtype)


def _uneven(node: fx.Node) -> Dict[int, tuple]:
    """Each producing rank's local shape of a value whose shards differ by rank, else {}
    (lower_plan writes each transfer with its sender's shape, See NOTE: Uneven splits)."""
    sig = node.meta.get(META_SBP)
    if sig is None or is_even(node.meta[META_TENSOR].shape, sig.out, sig.mesh):
        return {}
    return {r: local_shape(node.meta[META_TENSOR].shape, sig.out, sig.mesh, r) for r in flat(sig.mesh)}


def _reshard(node: fx.Node, stage: int, meshes: Dict[int, tuple]):
    """How `node` moves to `stage` if their meshes differ in shape (NOTE: Reshard pieces),
    else None: in the layout insert_boxing chose for its arrival there (broadcast for a value
    no op there converts)."""
    sig, mesh = node.meta.get(META_SBP), meshes.get(stage)
    if sig is None or mesh is None or same_shape(sig.mesh, mesh):
        return None
    arrival, mesh = node.meta.get(META_ARRIVAL, {}).get(stage, ((B,) * len(mesh_shape(mesh)), mesh))
    return Reshard(tuple(node.meta[META_TENSOR].shape), sig.out, sig.mesh, arrival, mesh)


def _stage_program(gm, s: int, nodes, loss, results, arg_index, meshes) -> StageProgram:
    g = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    inputs: List[str] = []
    user_inputs: Dict[str, int] = {}
    recv_from: Dict[int, List[TensorSpec]] = defaultdict(list)
    requires_grad: Dict[str, bool] = {}
    uneven: Dict[str, Dict[int, tuple]] = {}
    reshard: Dict[Tuple[str, int], Reshard] = {}   # (value, receiving stage) -> its pieces

    def value(n: fx.Node) -> fx.Node:
        if n not in env:  # produced on another stage: received
            producer = n.meta[META_STAGE]
            recv_from[producer].append(_spec(n, producer, s))
            requires_grad[n.name] = n.meta[META_TENSOR].requires_grad
            uneven[n.name] = _uneven(n)
            if (moved := _reshard(n, s, meshes)) is not None:
                reshard[(n.name, s)] = moved
            env[n] = _placeholder(g, n)
            inputs.append(n.name)
        return env[n]

    mine = [n for n in nodes if n.meta[META_STAGE] == s]
    for n in mine:
        if n.op == "placeholder":
            env[n] = _placeholder(g, n)
            inputs.append(n.name)
            user_inputs[n.name] = arg_index[n]
        else:
            env[n] = g.node_copy(n, value)

    outputs: List[str] = []
    send_to: Dict[int, List[TensorSpec]] = defaultdict(list)
    for n in mine:
        consumers = sorted({u.meta[META_STAGE] for u in n.users
                            if u.op != "output" and not is_backward(u) and u.meta[META_STAGE] != s})
        for c in consumers:
            send_to[c].append(_spec(n, s, c))
            requires_grad[n.name] = n.meta[META_TENSOR].requires_grad
            uneven[n.name] = _uneven(n)
            if (moved := _reshard(n, c, meshes)) is not None:
                reshard[(n.name, c)] = moved
        if consumers or n is loss or n in results:
            outputs.append(n.name)
    g.output(tuple(env[next(n for n in mine if n.name == name)] for name in outputs))
    module = fx.GraphModule(gm, g, class_name=f"Stage{s}")
    here = loss is not None and loss in env and loss.meta[META_STAGE] == s   # the loss is on this stage
    return StageProgram(
        stage=s, module=module, inputs=inputs, outputs=outputs, user_inputs=user_inputs,
        recv_from=dict(recv_from), send_to=dict(send_to), requires_grad=requires_grad,
        loss=loss.name if here else None,
        loss_summed=here and bool(getattr(loss.meta.get(META_ROWS), "summed", False)),
        results=[n.name for n in mine if n in results],
        uneven={name: shapes for name, shapes in uneven.items() if shapes}, reshard=reshard)


def _placeholder(g: fx.Graph, n: fx.Node) -> fx.Node:
    ph = g.placeholder(n.name)
    ph.meta.update({k: v for k, v in n.meta.items() if k in (META_TENSOR, META_STAGE)})
    return ph
