"""A compiled piece whose backward is two compiled parts: input gradients, then weight gradients.

NOTE: Split compiled backward
Zero-bubble schedules run a stage's backward as I (the gradients of its inputs, sent upstream
at once) and later W (its parameters' gradients, filling the pipeline's bubbles; NOTE:
Weight gradients). AOTAutograd gives a compiled piece one backward kernel program that
computes both, so under a split backward a piece is built here instead, from the same parts
Inductor's own path uses:

1. the joint forward-backward graph of the piece, its parameters as explicit inputs
   (`aot_export_joint_simple`, with Inductor's decompositions and under the autocast state
   of the call, the backward outside autocast as eager's);
2. AOTAutograd's min-cut partitioner cuts it into a forward and a backward graph (recompute
   tags honoured, NOTE: Recompute in compiled pieces);
3. the backward graph is cut once more: the *input part* is every node an input's gradient
   needs, the *weight part* the nodes only the parameters' gradients need; the values the
   weight part reads from the input part are the input part's extra outputs, kept between I
   and W with the output gradients; the saved tensors it reads it takes from autograd again
   in W (unpacked: a ZeRO-3 unit's parameters are whole again there, NOTE: ZeRO units);
4. forward, input part and weight part are each compiled by Inductor (no autograd inside).

`SplitFunction` (a torch.autograd.Function) joins them to the stage's autograd graph. Its
backward runs the input part; then, in a whole backward, the weight part at once; in I
(`input_gradients_only`, which the executor enters) the values the weight part reads wait on
the node for W, which runs the node again (NOTE: Weight gradients: an intermediate whose I
gave no parameter gradient is run from its kept output gradients) and gets the weight part
alone.

The joint export takes no output that is a view (of an input, `targets.view(-1)`, or of an
intermediate): such an output is a copy. A piece it still refuses (one that mutates an input,
a buffer's running statistic) is compiled whole, with a warning; its backward then runs in I.
A piece without trained parameters keeps its whole compiled backward (nothing for W).

The flag `input_gradients_only` sets is a ContextVar (each rank of the local world is a
thread), read on the thread that runs the backward. Where autograd runs a node on a device
thread (CUDA), the flag is unseen there: the piece's backward runs both parts in I, and W
accumulates the parameters' gradients I gave (NOTE: Weight gradients): the same numbers,
without the split.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import List, Tuple

import torch
import torch.fx as fx

from ..fx_graphs import ancestors, copy_subgraph
from ..ops.autocast import autocast_state, set_autocast


# set by the executor around I; a ContextVar, so that each rank of the local world (a thread)
# sees its own
_INPUTS_ONLY: ContextVar[bool] = ContextVar("graphc_input_gradients_only", default=False)


class SplitPiece:
    """The three compiled parts of one piece, and the parameters it reads, in order."""

    def __init__(self, forward, input_part, weight_part, params: List[torch.Tensor],
                 differentiable: List[bool], n_inputs: int, weight_reads: List[int]):
        self.forward = forward
        self.input_part = input_part
        self.weight_part = weight_part
        self.params = params
        self.differentiable = differentiable   # per output: whether it takes a gradient
        self.n_outputs = len(differentiable)
        self.n_inputs = n_inputs
        self.weight_reads = weight_reads   # the backward inputs (saved, then output gradients) W reads

    def __call__(self, *args):
        return SplitFunction.apply(self, *self.params, *args)


class SplitFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, piece: SplitPiece, *primals):
        with _outside_autocast():   # its casts are in the graph already
            got = piece.forward(*primals)
        outs, saved = got[:piece.n_outputs], got[piece.n_outputs:]
        ctx.piece = piece
        ctx.save_for_backward(*saved)
        ctx.kept = None
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, piece.differentiable) if not d])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        piece = ctx.piece
        n_params = len(piece.params)
        if ctx.kept is None:    # I, or a whole backward
            tangents = [g for g, d in zip(grads, piece.differentiable) if d]
            got = piece.input_part(*ctx.saved_tensors, *tangents)
            input_grads, computed = got[:piece.n_inputs], got[piece.n_inputs:]
            if _INPUTS_ONLY.get():
                ctx.kept = (computed, tangents)
                return (None,) + (None,) * n_params + tuple(input_grads)
            return (None,) + _weight_grads(ctx, computed, tangents) + tuple(input_grads)
        (computed, tangents), ctx.kept = ctx.kept, None   # W: the weight part alone
        return (None,) + _weight_grads(ctx, computed, tangents) + (None,) * piece.n_inputs


def _weight_grads(ctx, computed, tangents) -> tuple:
    """The weight part on what the input part computed and the backward inputs it reads, the
    saved ones unpacked again (ZeRO-3 units make their parameters whole there, NOTE: ZeRO units)."""
    inputs = list(ctx.saved_tensors) + list(tangents)
    return tuple(ctx.piece.weight_part(*computed, *[inputs[i] for i in ctx.piece.weight_reads]))


@contextlib.contextmanager
def input_gradients_only():
    """Inside, a SplitPiece's backward runs its input part only and keeps what its weight part
    needs for a later W (the executor's I: NOTE: Split compiled backward). Outside, both run."""
    token = _INPUTS_ONLY.set(True)
    try:
        yield
    finally:
        _INPUTS_ONLY.reset(token)


def split_backward(bw: fx.GraphModule, n_params: int) -> Tuple[fx.GraphModule, fx.GraphModule, List[int]]:
    """The backward graph cut in two (NOTE: Split compiled backward): the input part returns
    the inputs' gradients then the values it computes that the weight part reads; the weight
    part takes those, then the backward's own inputs it reads (their indices, returned too:
    W takes them from the saved tensors again, through autograd's unpack hooks), and returns
    the parameters' gradients. A gradient that is None stays a None output."""
    output = next(n for n in bw.graph.nodes if n.op == "output")
    grads = list(output.args[0])
    weight_grads, input_grads = grads[:n_params], grads[n_params:]
    for_inputs = ancestors(input_grads)
    for_weights = ancestors(weight_grads)
    second = [n for n in bw.graph.nodes if n in for_weights and n not in for_inputs and n.op != "placeholder"]
    inside = set(second)
    crossing = [n for n in bw.graph.nodes if n in for_weights and n not in inside
                and (n in weight_grads or any(u in inside for u in n.users))]
    computed = [n for n in crossing if n.op != "placeholder"]
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    reads = [n for n in crossing if n.op == "placeholder"]
    first = [n for n in bw.graph.nodes if n in for_inputs and n.op != "placeholder"]
    return (copy_subgraph(bw, first, placeholders, input_grads + computed),
            copy_subgraph(bw, second, computed + reads, weight_grads),
            [placeholders.index(n) for n in reads])


def build_split(piece: fx.GraphModule, args, compile_part) -> SplitPiece:
    """The piece's forward and split backward, each compiled by `compile_part(graph, examples)`
    (NOTE: Split compiled backward), for inputs like `args` in the current autocast state."""
    from torch._functorch.aot_autograd import aot_export_joint_simple
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    named = list(piece.named_parameters()) + list(piece.named_buffers())
    names, state = [n for n, _ in named], [t for _, t in named]
    grads_of = [t.requires_grad for t in state]
    n_state = len(state)

    def functional(*primals):   # an output that is a view is a copy (the joint export's rule)
        outs = torch.func.functional_call(piece, dict(zip(names, primals[:n_state])), tuple(primals[n_state:]))
        return tuple(o.clone() if o._is_view() or any(o is p for p in primals) else o for o in outs)
    primals = [s.detach().requires_grad_(g) for s, g in zip(state, grads_of)] + list(args)
    with torch.enable_grad():
        joint = aot_export_joint_simple(functional, tuple(primals), trace_joint=True,
                                        decompositions=select_decomp_table())
    differentiable = _differentiable(piece, joint, primals[n_state:])
    fw, bw = min_cut_rematerialization_partition(joint, primals, num_fwd_outputs=len(differentiable))
    first, second, reads = split_backward(bw, n_state)
    with torch.no_grad(), _outside_autocast():   # aten graphs, their casts traced in already
        parts = [compile_part(g, _examples(g)) for g in (fw, first, second)]
    return SplitPiece(*parts, state, differentiable, len(args), reads)


def _differentiable(piece: fx.GraphModule, joint: fx.GraphModule, args) -> List[bool]:
    """Per output, whether the joint graph takes a gradient for it: a floating value that
    reads a parameter or an input needing a gradient; checked against the joint's tangents."""
    needs = {n for n, a in zip(piece.graph.find_nodes(op="placeholder"), args)
             if isinstance(a, torch.Tensor) and a.requires_grad}
    for node in piece.graph.nodes:
        if _reads_trained(piece, node) or any(a in needs for a in node.all_input_nodes):
            needs.add(node)
    outputs = piece.graph.find_nodes(op="output")[0].args[0]
    values = joint.graph.find_nodes(op="output")[0].args[0][:len(outputs)]
    out = [o in needs and v.meta["val"].dtype.is_floating_point for o, v in zip(outputs, values)]
    tangents = [n for n in joint.graph.find_nodes(op="placeholder") if n.name.startswith("tangents")]
    if len(tangents) != sum(out):
        raise NotImplementedError(f"{len(tangents)} output gradients, expected {sum(out)}")
    return out


def _reads_trained(piece: fx.GraphModule, node: fx.Node) -> bool:
    """A parameter that needs a gradient, or a module call holding one."""
    if node.op == "get_attr":
        value = _attr(piece, node.target)
        return isinstance(value, torch.Tensor) and value.requires_grad
    if node.op == "call_module":
        return any(p.requires_grad for p in piece.get_submodule(node.target).parameters())
    return False


def _attr(module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module


@contextlib.contextmanager
def _outside_autocast():
    state = autocast_state()
    if not state:
        yield
        return
    set_autocast(())
    try:
        yield
    finally:
        set_autocast(state)


def _examples(graph: fx.GraphModule) -> List[torch.Tensor]:
    """Empty tensors like the graph's inputs (their fake values), to compile it for."""
    out = []
    for n in graph.graph.find_nodes(op="placeholder"):
        v = n.meta["val"]
        out.append(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device))
    return out
