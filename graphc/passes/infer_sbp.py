"""infer_sbp: gives every node an SBP signature, choosing among valid ones by boxing cost.

Invariant: every node but the output and backward() has node.meta[META_SBP], an
SbpSignature whose mesh is its stage's mesh, whose `out` has one SBP per mesh axis, and
whose `ins` names the SBP each tensor input must arrive in. User constraints are fixed:
an input's sbp, a parameter's to_global declaration, a to_global() inside build(). Per
mesh axis the rule table (graphc/sbp/rules.py, docs/sbp.md) lists valid signatures; the
one moving the fewest bytes wins, ties going to the rule's order. An op without a rule
gathers its inputs to broadcast and is marked `fallback`. Parameters whose gradient comes
out partial_sum on an axis get META_GRAD_PARTIAL (see NOTE: gradient layouts, docs/sbp.md).
Requires: decompose_modules (parameters as get_attr nodes), propagate_shapes.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.fx as fx

from ..errors import GraphcError
from ..log import get_logger
from ..meta import (META_BATCHED, META_BOXING, META_SBP, META_STAGE, META_TENSOR, SbpSignature,
                    is_backward)
from ..placement import Broadcast, PartialSum, Split, normalize_sbp
from ..sbp.declared import conversion_target, declared_in, to_global_op
from ..sbp.layout import B, flat, fmt, is_even, local_shape, mesh_shape, same_shape
from ..sbp.rules import RuleCtx, draws_random, rule_for
from ..sbp.context_parallel import ContextParallel, mark_attention
from ..sbp.sequence_parallel import no_partial_from_split, prefer_sequence_split, tensor_axes
from .sbp_choice_costs import _cost, _keeps_parameters, _widening
from .summed_grad_cone import _fetch, _mark_grad_partial

_log = get_logger("sbp")


def infer_sbp(gm: fx.GraphModule, meshes: Sequence[tuple], input_sbp: Sequence,
              num_microbatches: int = 1, sequence_parallel: bool = False,
              context_parallel: Optional[ContextParallel] = None) -> fx.GraphModule:
    # with sequence parallelism, the axes whose activations prefer split(seq): NOTE: Sequence parallel
    seq_axes = tensor_axes(gm) if sequence_parallel else {}
    # with context parallelism, attention may take a split sequence: NOTE: Context parallel
    mark_attention(gm, context_parallel)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    given = dict(zip(placeholders, list(input_sbp) + [None] * len(placeholders)))
    paid: Dict[tuple, set] = {}  # conversions already chosen: a second reader gets them free
    for node in gm.graph.nodes:
        if node.op == "output" or is_backward(node):
            continue
        if node.op == "call_function" and node.target is to_global_op:
            _move_to_target_stage(node, meshes)
        mesh = meshes[node.meta[META_STAGE]]
        if node.op == "placeholder":
            sig = SbpSignature(mesh, _input_sbp(node, given[node], mesh))
        elif node.op == "get_attr":
            sig = SbpSignature(mesh, _param_sbp(gm, node, mesh))
        elif node.op == "call_function" and node.target is to_global_op:
            sig = _conversion(node, mesh)
        else:
            sig = _choose(node, mesh, paid, seq_axes.get(node.meta[META_STAGE], ()), context_parallel is not None)
        if node.op == "placeholder":
            _check_microbatches(node, sig, num_microbatches)
        node.meta[META_SBP] = _single_rank_axes_broadcast(sig)
    _mark_grad_partial(gm)
    _warn_fallbacks(gm)
    return gm


def gathering_fallbacks(gm: fx.GraphModule) -> List[fx.Node]:
    """The ops without an SBP rule whose split or partial inputs are gathered to whole values
    on a stage of several ranks: the slow path _warn_fallbacks names. Read on the annotated
    graph or after insert_boxing (an input then arrives through its conversions: their
    sources are what was gathered)."""
    def gathers(node: fx.Node) -> bool:
        sig = node.meta.get(META_SBP)
        return sig is not None and sig.fallback and len(flat(sig.mesh)) > 1 and any(
            not all(isinstance(s, Broadcast) for s in layout) for a in node.all_input_nodes
            for layout in _layouts_before_boxing(a))
    return [node for node in gm.graph.nodes if gathers(node)]


def _layouts_before_boxing(a: fx.Node) -> List[tuple]:
    """The layouts value `a` had on its way to its reader: its own, or through a chain of
    conversion boxes (META_BOXING) each box's source layout and the first value's."""
    layouts = []
    while META_BOXING in a.meta:
        layouts.append(a.meta[META_BOXING].src)
        a = a.args[0]
    if META_SBP in a.meta:
        layouts.append(a.meta[META_SBP].out)
    return layouts


def _warn_fallbacks(gm: fx.GraphModule) -> None:
    """A slow path is said, once per compile: an op without an SBP rule whose split or
    partial inputs are gathered to whole values on a stage of several ranks (the plan marks
    the collective `fallback: <op>` too)."""
    found = []
    for node in gathering_fallbacks(gm):
        trace = node.meta.get("stack_trace", "").strip().splitlines()
        where = f" at {trace[-2].strip()}: {trace[-1].strip()}" if len(trace) >= 2 else ""
        found.append(f"'{node.name}' ({node.format_node().split('=', 1)[-1].strip()[:60]}){where}")
    if found:
        _log.warning("%d op(s) have no SBP rule and gather split or partial values to run whole on "
                     "every rank of their stage (a slow path: the batch or the weights are "
                     "all-gathered): %s", len(found), "; ".join(found[:5]) + (" ..." if len(found) > 5 else ""))


def _check_microbatches(node: fx.Node, sig: SbpSignature, m: int) -> None:
    """A split input's micro-batch k is every rank's k-th chunk of its rows: with uneven
    shards (See NOTE: Uneven splits) those must still be each rank's shard of micro-batch k."""
    meta = node.meta.get(META_TENSOR)
    if meta is None or m == 1 or not node.meta.get(META_BATCHED) or is_even(meta.shape, sig.out, sig.mesh):
        return
    whole = (meta.shape[0] * m,) + tuple(meta.shape[1:])
    ranks = flat(sig.mesh)
    rows = [local_shape(whole, sig.out, sig.mesh, r)[0] for r in ranks]
    per_mb = [local_shape(meta.shape, sig.out, sig.mesh, r)[0] for r in ranks]
    if rows != [m * k for k in per_mb]:
        raise GraphcError(
            f"input '{node.target}' (batch of {whole[0]} rows) is laid out as {fmt(sig.out)} on "
            f"ranks {list(ranks)}, which hold {rows} rows (torch.chunk's shards), but each of "
            f"the {m} micro-batches is every rank's next chunk of its rows, and {whole[0] // m} "
            f"rows per micro-batch would be held as {per_mb}. Fix: a batch whose shards divide "
            f"into {m} (e.g. a multiple of {m * len(ranks)} rows), or gradient accumulation 1.")


def _single_rank_axes_broadcast(sig: SbpSignature) -> SbpSignature:
    """On a mesh axis of one rank every layout is the whole tensor: write it broadcast."""
    sizes = mesh_shape(sig.mesh)

    def canon(sbp: tuple) -> tuple:
        return tuple(B if n == 1 else s for n, s in zip(sizes, sbp))
    return SbpSignature(sig.mesh, canon(sig.out), tuple((k, canon(v)) for k, v in sig.ins),
                        sig.fallback)


def _all_b(mesh: tuple) -> tuple:
    return (B,) * len(mesh_shape(mesh))


def _checked_sbp(given, value: fx.Node, mesh: tuple, what: str) -> tuple:
    """The user's sbp for `value`, normalised, with one entry per axis of `mesh`."""
    meta = value.meta.get(META_TENSOR)
    sbp = normalize_sbp(given, len(meta.shape) if meta else None, what)
    if len(sbp) != len(mesh_shape(mesh)):
        raise GraphcError(
            f"{what} with sbp {fmt(sbp)} has {len(sbp)} value(s) but runs on a mesh {mesh} with "
            f"{len(mesh_shape(mesh))} axis(es). Fix: give one sbp per mesh axis, e.g. "
            "sbp=(split(0), broadcast) on a 2-D placement.")
    return sbp


def _input_sbp(node: fx.Node, given, mesh: tuple) -> tuple:
    if given is None:
        return _all_b(mesh)
    return _checked_sbp(given, node, mesh, f"input '{node.name}' (stage {node.meta[META_STAGE]})")


def _param_sbp(gm: fx.GraphModule, node: fx.Node, mesh: tuple) -> tuple:
    t = _fetch(gm, str(node.target))
    layout = declared_in(gm).of(str(node.target)) if isinstance(t, torch.Tensor) else None
    if layout is None:
        return _all_b(mesh)
    where, sbp = layout.placement, layout.sbp
    if sorted(where.flat_ranks) != sorted(flat(mesh)) and same_shape(where.ranks, mesh) \
            and len(sbp) == len(mesh_shape(mesh)) and _shared_across_stages(gm, t):
        return sbp  # a tied weight: its layout holds on each stage that holds a copy (the
        # whole-graph scan runs only for a parameter read off its declared placement)
    if sorted(where.flat_ranks) != sorted(flat(mesh)) or len(sbp) != len(mesh_shape(mesh)):
        raise GraphcError(
            f"parameter '{node.target}' is declared on {where} with sbp {fmt(sbp)}, but its module "
            f"runs on stage {node.meta[META_STAGE]} with mesh {mesh}. Fix: declare it with "
            f"to_global on the stage's placement (ranks {list(flat(mesh))}), one sbp per mesh axis.")
    return sbp


def _shared_across_stages(gm: fx.GraphModule, t: torch.Tensor) -> bool:
    stages = {n.meta.get(META_STAGE) for n in gm.graph.nodes
              if n.op == "get_attr" and _fetch(gm, str(n.target)) is t}
    return len(stages) > 1


def _move_to_target_stage(node: fx.Node, meshes: Sequence[tuple]) -> None:
    """to_global onto another stage's placement converts there, after the transfer."""
    where = conversion_target(node).placement
    here = node.meta[META_STAGE]
    if sorted(where.flat_ranks) == sorted(flat(meshes[here])):
        return
    target = [s for s, m in enumerate(meshes) if sorted(flat(m)) == sorted(where.flat_ranks)]
    late = [u.name for u in node.users if u.op != "output" and target and
            u.meta.get(META_STAGE, target[0]) < target[0]]
    if not target or target[0] < here or late:
        raise GraphcError(
            f"to_global at '{node.name}' moves a value from stage {here} (ranks "
            f"{list(flat(meshes[here]))}) to {where}, which is "
            + ("no pipeline stage's placement" if not target else
               f"stage {target[0]}, but it is used on earlier stages by {late}") +
            ". Fix: convert only to the placement of a stage that runs after it "
            "(set_stage on the modules that use the result).")
    node.meta[META_STAGE] = target[0]


def _conversion(node: fx.Node, mesh: tuple) -> SbpSignature:
    """to_global inside build(): the value arrives in the declared sbp (boxed on this stage)."""
    target = conversion_target(node)
    where, sbp = target.placement, target.sbp
    sbp = _checked_sbp(sbp, node.args[0], mesh, f"to_global at '{node.name}' (to {where})")
    return SbpSignature(mesh, sbp, ((node.args[0].name, sbp),))


def _choose(node: fx.Node, mesh: tuple, paid: Dict[tuple, set], seq_axes=(),
            split_sequence: bool = False) -> SbpSignature:
    """The cheapest signature; `paid`: per (stage, axis), the conversions (value, SBP) that
    earlier nodes' signatures already need; on `seq_axes` a sequence value is split along
    the sequence where its rule allows (See NOTE: Sequence parallel). `split_sequence`
    (context parallelism): a split value leaving through an op that cannot keep its split
    is re-split or gathered, never zero-padded into a partial sum of the whole value."""
    inputs = [a for a in node.all_input_nodes if META_SBP in a.meta]
    tensors = [a for a in inputs if a.meta.get(META_TENSOR) is not None]
    rule = rule_for(node)
    if rule is None and not tensors and not draws_random(node):
        return SbpSignature(mesh, _all_b(mesh), ())  # host values, constants: alike everywhere
    if rule is None:
        return _fallback(node, mesh, tensors)
    outs, need = [], {a: [] for a in tensors}
    for axis, n in enumerate(mesh_shape(mesh)):
        prod = {a: _producer(a, node, axis, mesh) for a in inputs}
        found = rule(RuleCtx(node, n, prod, mesh_shape(mesh)[:axis],
                             {a: tuple(v) for a, v in need.items()}, tuple(outs)))
        if found is None:  # a case the rule does not cover
            return _fallback(node, mesh, tensors)
        cands = found + [({a: B for a in tensors}, B)]
        done = paid.setdefault((node.meta.get(META_STAGE), axis), set())
        # on a tie, a whole or split result over a partial one: a partial value is reduced
        # later by every reader that needs it whole (RMSNorm's x * rsqrt(var) after var's
        # reduce: Megatron's one all-reduce per residual, not two)
        best = min(cands, key=lambda c: (_cost(c, prod, n, done) + _widening(node, c, prod, n),
                                         isinstance(c[1], PartialSum)))
        if axis in seq_axes:
            best = prefer_sequence_split(node, cands, best, prod, lambda c: _cost(c, prod, n, done),
                                         lambda c: _keeps_parameters(c, prod))
        elif split_sequence:
            best = no_partial_from_split(cands, best, prod, lambda c: _cost(c, prod, n, done), split_only=True)
        done.update((a, r) for a, r in best[0].items() if r != prod[a])
        outs.append(best[1])
        for a in tensors:
            need[a].append(best[0].get(a, prod[a]))
    ins = tuple((a.name, tuple(v)) for a, v in need.items())
    return SbpSignature(mesh, tuple(outs), ins)


def _fallback(node: fx.Node, mesh: tuple, tensors: List[fx.Node]) -> SbpSignature:
    if node.op == "call_module":
        _check_module_params(node, mesh)
    b = _all_b(mesh)
    return SbpSignature(mesh, b, tuple((a.name, b) for a in tensors), fallback=True)


def _check_module_params(node: fx.Node, mesh: tuple) -> None:
    gm = node.graph.owning_module
    mod = gm.get_submodule(node.target)
    for name, p in list(mod.named_parameters()) + list(mod.named_buffers()):
        layout = declared_in(gm).of(f"{node.target}.{name}")
        if layout and not all(isinstance(s, Broadcast) for s in layout.sbp):
            raise GraphcError(
                f"module '{node.target}' ({type(mod).__name__}) has parameter '{name}' declared "
                f"{fmt(layout.sbp)}, but graphc has no SBP rule for {type(mod).__name__}, so it runs "
                "on whole tensors. Fix: declare its parameters sbp.broadcast, or write it with "
                "functional ops that have rules (see docs/sbp.md).")


def _producer(a: fx.Node, node: fx.Node, axis: int, mesh: tuple):
    """a's SBP on `axis` as `node` receives it. From a stage of another mesh shape a value
    moves in pieces to whatever layout its reader needs (NOTE: Reshard pieces); for costing,
    one split along a single dim carries over to a 1-D mesh (data parallel goes on, each rank
    receiving its rows), anything else counts as arriving broadcast."""
    src = a.meta[META_SBP]
    if same_shape(src.mesh, mesh):
        return src.out[axis]
    dims = {s.dim for s in src.out if isinstance(s, Split)}
    if len(mesh_shape(mesh)) == 1 and len(dims) == 1 and not any(
            isinstance(s, PartialSum) for s in src.out):
        return Split(dims.pop())
    return B
