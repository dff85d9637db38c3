"""find_batch_dims: which inputs carry the batch dimension, decided by data flow.

Invariant: every node has META_ROWS (the dim of its value that indexes the batch's rows,
and whether it is a sum or mean over them). The batch's rows are the rows the loss
averages over (a training graph) or the dim 0 of build()'s outputs (inference), followed
back to the inputs through every op (graphc/rows/rules.py); an input is split into
micro-batches (META_BATCHED, with decide_inputs) iff its dim 0 is such rows. An input
whose dim 0 never meets them (class prototypes [C, d] used as x @ P.T) is passed whole
to every micro-batch. Rows that an op mixes (a softmax across the batch, z @ z.T, a
batch mean used nonlinearly) are never split: under accumulation > 1 a graph whose
batch rows are all mixed (an in-batch contrastive loss) is refused, since per
micro-batch it would compute something else. Only ops the loss (or the outputs) depend
on count: a buffer updated in forward runs once per micro-batch, as in eager accumulation.
Requires: propagate_shapes. To decide, run on build() traced for the whole batch.
"""
from __future__ import annotations

from typing import Dict, FrozenSet, List

import torch
import torch.fx as fx

from ..errors import GraphcError
from ..meta import META_BATCHED, META_ROWS, META_TENSOR, RowsMeta, is_backward
from ..rows import Coupling, Rows, Symbols
from ..rows.rules import Ctx, default, rows_of


def find_batch_dims(gm: fx.GraphModule, num_microbatches: int,
                    decide_inputs: bool = True) -> fx.GraphModule:
    syms, events = Symbols(), []
    env: Dict[fx.Node, object] = {}
    for node in gm.graph.nodes:
        env[node] = _value(gm, node, env, syms, events)
    events += _pairs(env, syms)
    backward = next((n for n in gm.graph.nodes
                     if is_backward(n)), None)
    roots = [backward.args[0]] if backward is not None else gm.graph.output_node().all_input_nodes
    used = _ancestors(roots)  # what the loss (or the outputs) depends on; not buffer updates
    events = [e for e in events if e.node in used]
    candidates = _candidates(env, syms, events, roots, training=backward is not None)
    mixed = {c for e in events for c in _classes(e, syms)}
    batch = candidates - mixed
    if candidates and not batch and num_microbatches > 1:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}  # the first coupling in build()
        first = min((e for e in events if _classes(e, syms) & candidates), key=lambda e: order[e.node])
        raise _coupled(first, num_microbatches)
    for node, value in env.items():
        node.meta[META_ROWS] = _meta(value, batch, syms)
        if node.op == "placeholder" and decide_inputs:
            node.meta[META_BATCHED] = node.meta[META_ROWS].dim == 0
    return gm


def batched_inputs(gm: fx.GraphModule) -> List[bool]:
    """Per build() argument, whether it is split into micro-batches (after find_batch_dims)."""
    return [bool(n.meta.get(META_BATCHED)) for n in gm.graph.nodes if n.op == "placeholder"]


def input_names(gm: fx.GraphModule) -> List[str]:
    """build()'s argument names, in order."""
    return [n.target for n in gm.graph.nodes if n.op == "placeholder"]


def _value(gm, node: fx.Node, env, syms: Symbols, events: List[Coupling]):
    meta = node.meta.get(META_TENSOR)
    if node.op == "placeholder":
        if meta is None:
            return None
        return Rows(((syms.new(),) if meta.shape else ()) + (None,) * max(len(meta.shape) - 1, 0))
    if node.op == "get_attr":
        return _constant(gm, node, meta)
    if node.op == "output" or is_backward(node):
        return None
    module = gm.get_submodule(node.target) if node.op == "call_module" else None
    ctx = Ctx(node, env, syms, events, module)
    try:
        value = rows_of(ctx)
    except Exception:  # a rule that does not fit this call: fall back to the generic one
        value = default(ctx)
    if isinstance(value, Rows) and (meta is None or len(value.dims) != len(meta.shape)):
        value = Rows.none(len(meta.shape)) if meta is not None else None
    return value


def _constant(gm: fx.GraphModule, node: fx.Node, meta):
    """A parameter, buffer or constant: no rows; torch.arange(n) (a constant once traced)
    is marked as a position index, so x[torch.arange(n), y] reads as every row in order."""
    if meta is None:
        return None
    value = gm
    for part in node.target.split("."):
        value = getattr(value, part, None)
    position = (isinstance(value, torch.Tensor) and value.dim() == 1 and not value.is_floating_point()
                and not isinstance(value, torch.nn.Parameter)
                and torch.equal(value, torch.arange(len(value), dtype=value.dtype, device=value.device)))
    return Rows((None,) * len(meta.shape), position=position)


def _pairs(env, syms: Symbols) -> List[Coupling]:
    """A value with the same rows along two dims holds row-by-row pairs (z @ z.T)."""
    found = []
    for node, value in env.items():
        if isinstance(value, Rows):
            classes = [syms.find(s) for s in value.dims if s is not None]
            repeated = {c for c in classes if classes.count(c) > 1}
            if repeated:
                found.append(Coupling(node, "it pairs every row of the batch with every other row "
                                      "(e.g. z @ z.T)", frozenset(repeated)))
    return found


def _classes(e: Coupling, syms: Symbols) -> FrozenSet[int]:
    mine = syms.classes(e.symbols)
    return mine if e.meets is None else mine & syms.classes(e.meets)


def _candidates(env, syms: Symbols, events: List[Coupling], roots: List[fx.Node],
                training: bool) -> FrozenSet[int]:
    """Of the roots (the loss, or build()'s outputs without one): the rows the loss averages
    over, or the rows of the outputs' dim 0. Rows mixed by an op the roots depend on reach
    them too (torch.cov(x.T) is no mean, but it is the batch): they are candidates, which
    the mixing then rules out."""
    found: set = set()
    for root in roots:
        value = env.get(root)
        if isinstance(value, Rows):
            rows = value.symbols if training else ({value.dims[0]} - {None} if value.dims else set())
            found |= syms.classes(value.reduced | rows)
    found |= {c for e in events for c in _classes(e, syms)}
    return frozenset(found)


def _ancestors(roots: List[fx.Node]) -> set:
    seen, todo = set(), list(roots)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(node.all_input_nodes)
    return seen


def _meta(value, batch: FrozenSet[int], syms: Symbols) -> RowsMeta:
    if not isinstance(value, Rows):
        return RowsMeta(None, False)
    dim = next((d for d, s in enumerate(value.dims) if s is not None and syms.find(s) in batch), None)
    return RowsMeta(dim, bool(syms.classes(value.reduced) & batch))


def _coupled(e: Coupling, m: int) -> GraphcError:
    trace = e.node.meta.get("stack_trace", "").strip().splitlines()
    where = f"{trace[-2].strip()}: {trace[-1].strip()}" if len(trace) >= 2 else e.node.format_node()
    return GraphcError(
        f"build() couples rows of the batch at {where} (node '{e.node.name}'): {e.why}. With "
        f"{m} gradient accumulation steps each micro-batch would compute this on its own "
        "1/{m} of the rows, which changes what it means (an in-batch contrastive loss would "
        "compare each row with fewer others). Fix: use self.config."
        "set_gradient_accumulation_steps(1) for this graph (a smaller batch per step if memory "
        "is short), or make the loss a mean over independent rows.".replace("{m}", str(m)))
