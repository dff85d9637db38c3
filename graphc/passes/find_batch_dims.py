"""find_batch_dims: which inputs carry the batch dimension, decided by data flow.

Invariant: every node has META_ROWS (the dim of its value that indexes the batch's rows,
and whether it is a sum or mean over them). The batch's rows are the rows the loss
averages over (a training graph) or the dim 0 of build()'s outputs (inference), followed
back to the inputs through every op (graphc/batch_rows/rules.py); an input is split into
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

from typing import Dict, FrozenSet, List, Optional, Sequence

import torch
import torch.fx as fx

from ..errors import GraphcError
from ..fx_graphs import ancestors
from ..meta import META_BATCHED, META_ROWS, META_TENSOR, META_WHOLE_SUM, RowsMeta, is_backward
from ..batch_rows import Coupling, Rows, Symbols, WholeSums
from ..batch_rows.rules import Ctx, default, rows_of


def find_batch_dims(gm: fx.GraphModule, num_microbatches: int, decide_inputs: bool = True,
                    split: Optional[Sequence[bool]] = None) -> fx.GraphModule:
    """split: per input, whether split_inputs cuts it into micro-batches. Given, the analysis
    only confirms that choice or refuses it (NOTE: Batch split); without it, the rows are
    found from the data flow alone (inference, and graphs without accumulation)."""
    syms, events = Symbols(), []
    env: Dict[fx.Node, object] = {}
    for node in gm.graph.nodes:
        env[node] = _value(gm, node, env, syms, events)
        written = _mutated(node)
        if written is not None and written.op != "placeholder":  # an input keeps its own rows
            env[written] = env[node]  # later readers of the tensor see what was written into it
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    chosen = [] if split is None else [env[p].dims[0] for p, s in zip(placeholders, split)
                                       if s and isinstance(env[p], Rows) and env[p].dims]
    for s in chosen[1:]:  # the rule says: these are the same rows, the batch's
        syms.union(chosen[0], s)
    events += _pairs(env, syms)
    backward = next((n for n in gm.graph.nodes
                     if is_backward(n)), None)
    roots = [backward.args[0]] if backward is not None else gm.graph.output_node().all_input_nodes
    used = ancestors(roots + _writes_into(gm, ancestors(roots)))  # not buffer updates
    wholes = [e for e in events if isinstance(e, WholeSums) and e.node in used]
    read_by_roots = set(used)
    if backward is not None and split is not None:   # what build() returns is merged too
        used |= ancestors(gm.graph.output_node().all_input_nodes)   # (NOTE: Batch sums)
    events = [e for e in events if isinstance(e, Coupling) and e.node in used]
    if split is not None:
        batch = syms.classes(chosen)
        _confirm_split(gm, env, syms, events, batch, placeholders, split, num_microbatches, read_by_roots)
    else:
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
    if num_microbatches > 1:
        _mark_whole_sums(gm, env, syms, [e for e in wholes if _classes(e, syms) & batch], num_microbatches)
    _mark_sums(gm, num_microbatches)
    return gm


def _confirm_split(gm, env, syms: Symbols, events: List[Coupling], batch: FrozenSet[int],
                   placeholders, split: Sequence[bool], m: int, read_by_roots: set) -> None:
    """NOTE: Batch split. The inputs split_inputs cuts are the batch's rows; the data flow
    must agree: no op may mix those rows (per micro-batch it would compute something else),
    and an input kept whole must not line up with them."""
    if m <= 1 or not batch:
        return
    names = [p.target for p, s in zip(placeholders, split) if s]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    mixing = sorted((e for e in events if _classes(e, syms) & batch), key=lambda e: order[e.node])
    if mixing:
        raise _coupled(mixing[0], m, names, returned_only=mixing[0].node not in read_by_roots)
    for p, s in zip(placeholders, split):
        value = env.get(p)
        if not s and isinstance(value, Rows) and value.dims and value.dims[0] is not None \
                and syms.find(value.dims[0]) in batch:
            raise GraphcError(
                f"input '{p.target}' is passed whole to every micro-batch (marked with "
                f"config.set_whole_inputs), but build() lines its dim 0 up with the rows of the "
                f"batch ({', '.join(repr(n) for n in names)}), so each micro-batch would pair its "
                f"rows with the wrong rows of '{p.target}'. Fix: remove '{p.target}' from "
                "config.set_whole_inputs so it is split with the batch.")


def _mark_whole_sums(gm, env, syms: Symbols, wholes: List[WholeSums], m: int) -> None:
    """NOTE: Whole-batch sums (passes/feed_whole_sums.py): the first reductions over the
    batch's rows behind each count get META_WHOLE_SUM; each must be a floating sum without
    gradient (a mean over micro-batches of an integer count is no integer)."""
    for e in wholes:
        for leaf in _first_sums(e.counts, env, syms):
            meta = leaf.meta.get(META_TENSOR)
            if meta is None or meta.requires_grad or not getattr(torch, meta.dtype).is_floating_point:
                why = (f"the sum over the batch at node '{leaf.name}' is combined nonlinearly, and "
                       "it " + ("carries a gradient" if meta is None or meta.requires_grad else
                                f"is an integer count ({meta.dtype}): make it floating"))
                raise _coupled(Coupling(e.node, why, e.symbols), m)
            leaf.meta[META_WHOLE_SUM] = True


def _first_sums(counts, env, syms: Symbols) -> List[fx.Node]:
    """The nodes behind `counts` that reduce the batch's rows themselves (their inputs are
    not yet reduced): a router's histc, a mask's sum."""
    found, seen, todo = [], set(), list(counts)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        reduced = [a for a in node.all_input_nodes if isinstance(env.get(a), Rows) and env[a].reduced]
        if reduced:
            todo.extend(reduced)
        elif isinstance(env.get(node), Rows) and env[node].reduced:
            found.append(node)
    return found


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
    """A parameter, buffer or constant: no rows; torch.arange(n) (a constant once traced),
    also reshaped along one axis (arange(b)[:, None]) or flat with each entry repeated
    (arange(n).repeat_interleave(k), an MoE's token of each pair), is marked as a position
    index, so x[torch.arange(n), y] reads as every row in order."""
    if meta is None:
        return None
    value = gm
    for part in node.target.split("."):
        value = getattr(value, part, None)
    each = _repeated_positions(value)
    return Rows((None,) * len(meta.shape), position=each > 0, repeats=max(each, 1))


def _repeated_positions(value) -> int:
    """k if value is arange(n).repeat_interleave(k) (k = 1: arange(n), also along one axis
    of several), else 0."""
    if not (isinstance(value, torch.Tensor) and value.dim() >= 1 and not value.is_floating_point()
            and value.dtype != torch.bool and not value.is_complex()
            and not isinstance(value, torch.nn.Parameter) and value.numel() > 0
            and sum(1 for k in value.shape if k != 1) <= 1):  # arange(n), or arange(n)[:, None]
        return 0
    flat = value.reshape(-1)
    rows = int(flat[-1]) + 1
    each = flat.numel() // rows if value.dim() == 1 and rows > 0 else 1
    positions = torch.arange(max(rows, 0), dtype=value.dtype, device=value.device).repeat_interleave(each)
    return each if each * rows == flat.numel() and torch.equal(flat, positions) else 0


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


def _classes(e, syms: Symbols) -> FrozenSet[int]:
    mine = syms.classes(e.symbols)
    meets = getattr(e, "meets", None)
    return mine if meets is None else mine & syms.classes(meets)


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


def _mutated(node: fx.Node) -> Optional[fx.Node]:
    """The tensor an in-place method writes into (`out.index_add_(0, i, src)` with its result
    unused: the readers of `out` read the node `out` is, not this one). Not a parameter or
    buffer: a buffer updated in forward runs once per micro-batch, as in eager accumulation."""
    name = node.target if node.op == "call_method" else ""
    base = node.args[0] if node.args else None
    if name.endswith("_") and not name.endswith("__") and isinstance(base, fx.Node) and base.op != "get_attr":
        return base
    return None


def _writes_into(gm: fx.GraphModule, used: set) -> List[fx.Node]:
    """In-place writes into a tensor the loss (or the outputs) reads: they count as read too."""
    return [n for n in gm.graph.nodes if _mutated(n) in used]


def _meta(value, batch: FrozenSet[int], syms: Symbols) -> RowsMeta:
    if not isinstance(value, Rows):
        return RowsMeta(None, False)
    dim = next((d for d, s in enumerate(value.dims) if s is not None and syms.find(s) in batch), None)
    return RowsMeta(dim, bool(syms.classes(value.reduced) & batch))


def _coupled(e: Coupling, m: int, split: Optional[List[str]] = None,
             returned_only: bool = False) -> GraphcError:
    trace = e.node.meta.get("stack_trace", "").strip().splitlines()
    where = f"{trace[-2].strip()}: {trace[-1].strip()}" if len(trace) >= 2 else e.node.format_node()
    if returned_only:   # only a value build() returns reads it (NOTE: Batch sums)
        return GraphcError(
            f"a value build() returns couples rows of the batch at {where} (node "
            f"'{e.node.name}'): {e.why}. The inputs {split} are split into {m} micro-batches, and "
            "the value each one computes, merged, is not what eager computes on the whole batch. "
            "Fix: return the sum or mean itself and apply the op after the call (e.g. "
            "torch.exp(loss) for a perplexity), or self.config.set_gradient_accumulation_steps(1).")
    if split is not None:
        return GraphcError(
            f"build() couples rows of the batch at {where} (node '{e.node.name}'): {e.why}. The "
            f"inputs {split} are split into {m} micro-batches along dim 0 (their dim 0 is the "
            "batch size), and per micro-batch this op would compute something else. Fix: if an "
            "input there is not per-example data (a table, a matrix that happens to have the "
            "batch's length), mark it with self.config.set_whole_inputs(\"name\"); if the op "
            "really compares rows across the batch (an in-batch contrastive loss), use "
            "self.config.set_gradient_accumulation_steps(1).")
    return GraphcError(
        f"build() couples rows of the batch at {where} (node '{e.node.name}'): {e.why}. With "
        f"{m} gradient accumulation steps each micro-batch would compute this on its own "
        "1/{m} of the rows, which changes what it means (an in-batch contrastive loss would "
        "compare each row with fewer others). Fix: use self.config."
        "set_gradient_accumulation_steps(1) for this graph (a smaller batch per step if memory "
        "is short), or make the loss a mean over independent rows.".replace("{m}", str(m)))


# NOTE: Batch sums. A value build() returns that is reduced over the batch comes back as
# eager computes it on the whole batch: a mean of per-micro-batch means, but a sum of
# per-micro-batch sums (`n_correct = (pred == y).sum()`, of any dtype). The kind is read back
# from the output through casts and scalings to the reduction that made it; `s / n` with n
# the number of entries s summed (x.shape[0], x.numel() of the micro-batch) is a mean, while
# a sum scaled by anything else (a number, or a tensor without the batch's rows: a count of
# the whole batch passed in, as transformers' `num_items_in_batch`) stays a sum. The loss
# follows the same rule: a batch-sum loss (`loss.sum() / num_items_in_batch`) is the sum of
# its micro-batches' parts, so each micro-batch's gradient counts whole, where a batch
# mean's counts 1/m (StageProgram.loss_weight). Under accumulation, what no merge of the
# micro-batches' values can give is refused at the user's line: a value adding a sum over the
# batch to a mean over it (the loss or a returned value), a max or min over the batch's rows
# returned, and (find_batch_dims) a returned value that puts a sum or mean over the batch
# through a nonlinear op (torch.exp(loss) per micro-batch, averaged, is not exp of the
# batch's loss). A value made by an op not followed here keeps the mean (as before).
_SUMS = frozenset({"sum", "nansum", "count_nonzero"})
_MEANS = frozenset({"mean", "nanmean"})
_KEEPS = frozenset({"float", "double", "half", "bfloat16", "long", "int", "short", "to", "type", "type_as",
                    "detach", "clone", "neg", "contiguous", "squeeze", "unsqueeze", "view", "reshape",
                    "flatten", "getitem"})
_SCALES = frozenset({"mul", "truediv", "div", "divide", "true_divide"})
_EXTREMES = frozenset({"max", "min", "amax", "amin"})
_LOSS_MODULES = (torch.nn.modules.loss._Loss,)


def _mark_sums(gm: fx.GraphModule, m: int) -> None:
    """Marks build()'s outputs and the loss that are batch sums (NOTE: Batch sums); with
    m > 1 micro-batches, refuses those no merge of their parts gives."""
    backward = next((n for n in gm.graph.nodes if is_backward(n)), None)
    loss = [backward.args[0]] if backward is not None and isinstance(backward.args[0], fx.Node) else []
    for node in gm.graph.output_node().all_input_nodes + loss:
        meta = node.meta.get(META_ROWS)
        if meta is None or meta.dim is not None or not meta.reduced:
            continue
        kind = _kind(gm, node)
        if kind == "sum":
            node.meta[META_ROWS] = RowsMeta(None, True, summed=True)
        elif kind in _UNMERGED and m > 1:
            raise _unmerged(node, kind, m, node in loss)


_UNMERGED = {"mixed": ("adds a sum over the batch's rows to a mean over them: the micro-batches' "
                       "parts of a sum add up and those of a mean average, and a mix is neither",
                       "make both terms sums (divide by the whole batch's count) or both means, "
                       "or return the two terms separately and combine them after the call"),
             "extreme": ("is a max or min over the batch's rows, which the micro-batches' values "
                         "averaged are not",
                         "return the per-row values (e.g. out.amax(dim=1)) and reduce them after "
                         "the call")}


def _unmerged(node: fx.Node, kind: str, m: int, is_loss: bool) -> GraphcError:
    trace = node.meta.get("stack_trace", "").strip().splitlines()
    where = f"{trace[-2].strip()}: {trace[-1].strip()}" if len(trace) >= 2 else node.format_node()
    what, fix = _UNMERGED[kind]
    return GraphcError(
        f"{'the loss' if is_loss else 'a value build() returns'} at {where} (node '{node.name}') "
        f"{what}; with {m} gradient accumulation steps it would not be what eager computes on "
        f"the whole batch (NOTE: Batch sums). Fix: {fix}; or "
        "self.config.set_gradient_accumulation_steps(1).")


def _name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target)).lstrip("_")


def _kind(gm: fx.GraphModule, node: fx.Node, depth: int = 0) -> Optional[str]:
    """'sum', 'mean' or None (unknown) for a value reduced over the batch's rows."""
    if depth > 32 or not isinstance(node, fx.Node) or node.op in ("placeholder", "get_attr"):
        return None
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        reduction = getattr(module, "reduction", None) if isinstance(module, _LOSS_MODULES) else None
        return {"sum": "sum", "mean": "mean"}.get(reduction)
    name, first = _name(node), node.args[0] if node.args else None
    rows = first.meta.get(META_ROWS) if isinstance(first, fx.Node) else None
    if name in _SUMS or name in _MEANS:
        if rows is not None and rows.dim is not None:
            return "sum" if name in _SUMS else "mean"
        return _kind(gm, first, depth + 1)
    if name.endswith("loss") or name in ("cross_entropy", "binary_cross_entropy_with_logits"):
        return {"sum": "sum", "mean": "mean"}.get(node.kwargs.get("reduction", "mean"))
    if name in _KEEPS:
        return _kind(gm, first, depth + 1)
    if name in _SCALES:
        return _scaled_kind(gm, node, name, depth)
    if name in ("add", "sub", "iadd", "isub"):
        kinds = {_kind(gm, a, depth + 1) for a in node.args if _reduced(a)}
        if "mixed" in kinds or {"sum", "mean"} <= kinds:
            return "mixed"
        return kinds.pop() if len(kinds) == 1 else None
    if name in _EXTREMES and rows is not None and rows.dim is not None:
        return "extreme"
    return None


def _scaled_kind(gm: fx.GraphModule, node: fx.Node, name: str, depth: int) -> Optional[str]:
    """x * c or x / c, with x reduced over the batch and c a number or a tensor without the
    batch's rows: x's kind, except that a sum divided by its own number of entries is a mean."""
    if len(node.args) != 2 or node.kwargs:
        return None
    x, c = node.args
    if name == "mul" and not _reduced(x):
        x, c = c, x
    if not _reduced(x) or not _without_rows(c):
        return None
    kind = _kind(gm, x, depth + 1)
    if kind == "sum" and name != "mul" and _number(gm, c) in _counts(gm, x):
        return "mean"
    return kind


def _reduced(a) -> bool:
    return isinstance(a, fx.Node) and (a.meta.get(META_ROWS) or RowsMeta(None, False)).reduced


def _without_rows(c) -> bool:
    """A number, or a tensor that neither holds the batch's rows nor is reduced over them
    (the same on every micro-batch: a count passed in whole, a parameter)."""
    if isinstance(c, fx.Node):
        rows = c.meta.get(META_ROWS)
        return c.meta.get(META_TENSOR) is not None and rows is not None and rows.dim is None \
            and not rows.reduced
    return isinstance(c, (int, float)) and not isinstance(c, bool)


def _number(gm: fx.GraphModule, c) -> Optional[float]:
    """c's value where the trace made it a constant (a number, or a one-element tensor such
    as torch.tensor(x.shape[0])), else None. A module's buffer is the user's own value, the
    same for the whole batch as for a micro-batch: no count of the micro-batch."""
    if not isinstance(c, fx.Node):
        return c
    if c.op != "get_attr" or c.target in dict(gm.named_buffers()):
        return None
    value = gm
    for part in c.target.split("."):
        value = getattr(value, part, None)
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and value.numel() == 1:
        return value.item()
    return None


def _counts(gm: fx.GraphModule, node: fx.Node, depth: int = 0) -> set:
    """How many entries the sum at (or below) `node` added up: every dim, or its rows."""
    while _name(node) in _KEEPS and node.args and isinstance(node.args[0], fx.Node) and depth < 32:
        node, depth = node.args[0], depth + 1
    src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    meta = src.meta.get(META_TENSOR) if src is not None else None
    if _name(node) not in _SUMS or meta is None:
        return set()
    shape = list(meta.shape)
    total = 1
    for n in shape:
        total *= n
    return {total, shape[0]} if shape else {total}
