"""check_batch_sizes: build()'s plan for one micro-batch means what build() means on the whole batch
wherever the batch's size enters as a number or a tensor made from it (or is refused), and
returns the whole batch's constants.

NOTE: Batch size in a micro-batch
Under accumulation > 1 build() is traced twice, for the whole batch and for one micro-batch
(NOTE: Batch split), and the plan runs the micro-batch's trace. What build() takes from the
batch's size (`b = x.shape[0]`, `len(x)`) is the whole batch's in eager and the micro-batch's
in the plan. That is what micro-batching means where the size shapes the batch's own rows
(`h.view(b, t, -1)`, `cls.expand(b, -1, -1)`), turns a batch sum into a batch mean
(`loss.sum() / b`), or makes a tensor whose every micro-batch part is the whole batch's
(`torch.ones(b)`); anywhere else the step computes something else, silently: `reg / b` beside a
mean loss reads 1/4 where eager reads 1/8, and `torch.arange(b) / b` as row weights gives
every micro-batch the first rows' weights. The two traces run the same ops, so they are
compared node by node:
- a node whose Python arguments differ between them read the size as a number; its value
  must hold the batch's rows or be a sum or mean over them (META_ROWS of the whole trace),
  unless it makes a tensor (judged where it meets the rows, below);
- a tensor made without the batch (factories, constants and numbers only; random draws
  aside) that lines up with the batch's rows in an op is computed in both traces: each
  micro-batch's must equal its part of the whole batch's.
Either failure is refused at the user's line, with the fix. What build() returns as a Python
number or a tensor constant (`{"rows": x.shape[0]}`) is no value of the plan: it is returned as
the whole batch's trace has it, as eager returns it.
Requires: propagate_shapes and find_batch_dims on both traces; their ops in the same order
(else NOTE: Writes of the first call, and nothing is compared here).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..errors import GraphcError
from ..fx_graphs import ancestors, copy_subgraph
from ..meta import META_ROWS, META_TENSOR
from ..ops.random_ops import RANDOM_FUNCTIONS, RANDOM_METHODS
from .user_lines import node_line

_COMPUTED_MAX = 1 << 22   # the most entries of a made tensor computed to compare its parts
_FIX = ("Fix: write the number down (the whole batch's size, or a count passed in as a 0-d tensor "
        "input, which graphc gives every micro-batch whole), pass per-row values in as an input "
        "with the batch (it is then split with it), or use self.config.set_gradient_accumulation_steps(1).")


def check_batch_sizes(whole: fx.GraphModule, gm: fx.GraphModule, num_microbatches: int) -> None:
    """Refuses a use of the batch's size that micro-batching would change (NOTE: Batch size in
    a micro-batch). whole: build() traced for the whole batch (annotated); gm: for one
    micro-batch, the plan's."""
    if num_microbatches <= 1 or whole is None or _ops(whole) != _ops(gm):
        return
    pairs = list(zip(whole.graph.nodes, gm.graph.nodes))
    twin = {a: b for a, b in pairs}
    made = _made_nodes(whole)
    for a, b in pairs:
        if a.op in ("call_function", "call_method", "call_module"):
            _check_number(a, b, num_microbatches)
            _check_made_tensors(whole, gm, a, twin, made, num_microbatches)
    _return_whole_constants(whole, gm)


def _return_whole_constants(whole: fx.GraphModule, gm: fx.GraphModule) -> None:
    """What build() returns that is no value of the plan (a Python number, a tensor constant:
    `{"rows": x.shape[0]}`) is returned as the whole batch's trace has it, as eager returns it."""
    a, b = whole.graph.output_node(), gm.graph.output_node()
    whole_leaves, _ = pytree.tree_flatten(a.args)
    leaves, spec = pytree.tree_flatten(b.args)
    if len(leaves) != len(whole_leaves):
        return
    for i, (x, y) in enumerate(zip(whole_leaves, leaves)):
        if not isinstance(x, fx.Node) and not isinstance(y, fx.Node) and x != y:
            leaves[i] = x
        elif isinstance(x, fx.Node) and isinstance(y, fx.Node) and x.op == y.op == "get_attr" \
                and x.target.startswith("_tensor_constant"):
            value = getattr(whole, x.target)
            if not torch.equal(value, getattr(gm, y.target)):
                setattr(gm, y.target, value)
    b.args = pytree.tree_unflatten(leaves, spec)


def _ops(gm: fx.GraphModule) -> list:
    return [(n.op, n.target if isinstance(n.target, str) else getattr(n.target, "__name__", repr(n.target)))
            for n in gm.graph.nodes]


def _constants(node: fx.Node) -> list:
    """node's arguments that are not traced values, in order."""
    found: list = []
    fx.node.map_aggregate((node.args, node.kwargs), lambda v: None if isinstance(v, fx.Node) else found.append(v))
    return found


def _check_number(a: fx.Node, b: fx.Node, m: int) -> None:
    """A node that read a number made from the batch's size: its whole-batch value must hold
    the rows, or be reduced over them, or be a tensor made from nothing traced."""
    if _constants(a) == _constants(b) or not a.all_input_nodes or _shape(a) != _shape(b):
        return   # the size made a shape (the tensor is judged where it meets the rows)
    rows = a.meta.get(META_ROWS)
    if rows is None or rows.dim is not None or rows.reduced:
        return
    numbers = [(x, y) for x, y in zip(_constants(a), _constants(b)) if x != y]
    raise GraphcError(
        f"build() reads the batch's size as a number at {node_line(a)} (node '{a.name}': "
        f"{_shown(numbers)}): the plan runs each of the {m} micro-batches on its own rows, where this "
        "value would read the micro-batch's size, not the whole batch's as in eager, and it is "
        "neither a value of the batch's rows nor a sum or mean over them (`loss.sum() / x.shape[0]` "
        "is; `penalty / x.shape[0]` beside a mean loss is not). " + _FIX)


def _shape(node: fx.Node) -> Optional[tuple]:
    meta = node.meta.get(META_TENSOR)
    return tuple(meta.shape) if meta is not None else None


def _shown(numbers) -> str:
    whole, micro = numbers[0]
    return f"{_short(whole)} for the whole batch, {_short(micro)} for a micro-batch"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_made_tensors(whole: fx.GraphModule, gm: fx.GraphModule, a: fx.Node, twin, made: set, m: int) -> None:
    """The tensors made without the batch that `a` lines up with its rows (by broadcasting,
    as an elementwise op does): each micro-batch's must be its part of the whole batch's."""
    rows = a.meta.get(META_ROWS)
    out = a.meta.get(META_TENSOR)
    if rows is None or rows.dim is None or out is None:
        return
    row_dim, ndim = rows.dim, len(out.shape)
    for x in a.args:
        if not isinstance(x, fx.Node) or x.meta.get(META_TENSOR) is None:
            continue
        shape = tuple(x.meta[META_TENSOR].shape)
        d = row_dim - (ndim - len(shape))
        if d < 0 or shape[d] <= 1 or x not in made:
            continue
        whole_value, micro_value = _computed(whole, x), _computed(gm, twin[x])
        if whole_value is None or micro_value is None:
            continue
        if not _parts_equal(whole_value, micro_value, d, m):
            raise GraphcError(
                f"build() makes a tensor of the batch's length at {node_line(x)} (node '{x.name}', "
                f"shape {list(shape)}) and lines it up with the batch's rows at {node_line(a)}: its "
                f"values differ along those rows, and the plan makes it again for each of the {m} "
                "micro-batches from the micro-batch's size, so every micro-batch would read the "
                "first rows' values (`torch.arange(x.shape[0])` as row weights). " + _FIX)


def _made_nodes(gm: fx.GraphModule) -> set:
    """The nodes computed from factories, constants and numbers alone (no input, parameter,
    buffer or module; no random draw), in one pass over the graph."""
    made: set = set()
    for n in gm.graph.nodes:
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        if n.op in ("placeholder", "call_module", "output") or name in RANDOM_FUNCTIONS or name in RANDOM_METHODS:
            continue
        if n.op == "get_attr" and not n.target.startswith("_tensor_constant"):
            continue
        if all(i in made for i in n.all_input_nodes):
            made.add(n)
    return made


def _computed(owner: fx.GraphModule, x: fx.Node) -> Optional[torch.Tensor]:
    meta = x.meta.get(META_TENSOR)
    if meta is not None and _numel(meta.shape) > _COMPUTED_MAX:
        return None
    needed = ancestors([x])
    nodes: List[fx.Node] = [n for n in owner.graph.nodes if n in needed]
    try:
        value = copy_subgraph(owner, nodes, [], [x])()[0]
    except Exception:   # noqa: BLE001 - a piece that does not run alone is not judged here
        return None
    return value if isinstance(value, torch.Tensor) else None


def _numel(shape) -> int:
    total = 1
    for s in shape:
        total *= int(s)
    return total


def _parts_equal(whole: torch.Tensor, micro: torch.Tensor, d: int, m: int) -> bool:
    if whole.dim() != micro.dim() or whole.shape[d] != m * micro.shape[d]:
        return False
    return all(torch.equal(part, micro) for part in whole.chunk(m, d))
