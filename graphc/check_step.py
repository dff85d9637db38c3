"""config.set_check_microbatching(True): the first step is also run eagerly, and compared.

NOTE: Checked first step
A safety net for a new model: on the first call, rank 0 also runs build() eagerly on a copy
of the model, on the whole batch (every rank's part of each input gathered), steps a copy of
the optimizer with the same hyperparameters, and compares the loss and every parameter with
what graphc's step produced (gathered with full_state_dict). Any difference beyond the
tolerance of the parameters' dtype is a GraphcError on every rank, reporting the largest
loss and parameter differences by name; it catches what no static analysis can promise
(an input split that should not be, a rule that does not fit a model's op). The check
costs one eager step and two state gathers, once. Random ops (dropout) draw differently in
eager than in graphc's seeded programs, so a plan with random ops is checked only for its
shapes and a warning says so.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from . import world as ranks
from .dcp import user_prefix
from .errors import GraphcError
from .global_tensor import GlobalTensor
from .log import warn_user

# relative tolerance by the parameters' dtype: graphc only reorders sums (helpers.py's oracle)
RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}


class FirstStepCheck:
    """What the check needs from before the step: the inputs, the model and the optimizer."""

    def __init__(self, graph, groups):
        self.graph, self.groups = graph, groups
        self.rank, self.world = 0, 1  # known once compiled (graphc starts the process group)
        self.inputs: List[torch.Tensor] = []
        self.tree = None
        self.before: Dict[str, torch.Tensor] = {}

    def start(self, inputs: Tuple[Any, ...]) -> None:
        """Once compiled, before graphc's step: the whole batch and the model's state."""
        self.rank, self.world = _rank_world()
        is_leaf = lambda x: isinstance(x, GlobalTensor)  # noqa: E731 - one input each
        leaves, self.tree = pytree.tree_flatten(tuple(inputs), is_leaf=is_leaf)  # NOTE: Input trees
        self.inputs = _gather_inputs(leaves, self.rank, self.world)
        self.before = self.graph.full_state_dict(rank0_only=True)

    def compare(self, outputs) -> None:
        """After graphc's step: rank 0 runs eager and compares; every rank gets the verdict."""
        graph = self.graph
        after = graph.full_state_dict(rank0_only=True)
        loss = _first_scalar(outputs)
        losses = [None] * self.world
        if self.world > 1:
            losses = ranks.current().all_gather_object(None if loss is None else float(loss))
        else:
            losses = [None if loss is None else float(loss)]
        report = ""
        if self.rank == 0:
            report = self._run_eager_and_compare(after, next((x for x in losses if x is not None), None))
        if self.world > 1:
            report = ranks.current().broadcast_object(report, src=0)
        if report:
            raise GraphcError(report)

    def _run_eager_and_compare(self, after: Dict[str, torch.Tensor], loss: Optional[float]) -> str:
        graph = self.graph
        root = _eager_root(graph, self.before)
        if graph._optimizer is not None and self.groups:
            params = dict(root.named_parameters())
            groups = [dict(opts, params=[params[n] for n in names if n in params]) for opts, names in self.groups]
            opt = type(graph._optimizer)(groups)
            opt.zero_grad(set_to_none=True)
        else:
            opt = None
        out = type(graph).build(root, *pytree.tree_unflatten(self.inputs, self.tree))
        if opt is not None:
            opt.step()
        want_loss = _first_scalar(out)
        want = root.state_dict()
        prefix = user_prefix(graph._root)  # full_state_dict's keys drop it
        rows = []
        for k, v in want.items():
            got = after.get(k[len(prefix):] if prefix and k.startswith(prefix) else k)
            if got is None or not torch.is_floating_point(v):
                continue
            diff = (got.to(v.dtype) - v.detach()).abs().max().item() if v.numel() else 0.0
            scale = max(v.detach().abs().max().item() if v.numel() else 0.0, 1.0)
            if diff > RTOL.get(v.dtype, 1e-2) * scale:
                rows.append((diff, k))
        dloss = None
        if loss is not None and want_loss is not None:
            dloss = abs(loss - float(want_loss))
            tol = RTOL.get(want_loss.dtype, 1e-2) * max(abs(float(want_loss)), 1.0)
            if dloss > tol:
                rows.append((dloss, "<loss>"))
        if not rows:
            return ""
        rows.sort(reverse=True)
        shown = "\n".join(f"  {name}: max |difference| {d:.3g}" for d, name in rows[:8])
        return (f"{type(graph).__name__}: the first step differs from eager PyTorch on the whole "
                f"batch (config.set_check_microbatching): {len(rows)} value(s) differ, largest first "
                f"(loss {loss} vs eager {None if want_loss is None else float(want_loss)}):\n{shown}\n"
                "  graphc split the batch, the model or its gradients in a way that changes what "
                "the step computes. Fix: check which inputs are split (a table of the batch's "
                "length needs config.set_whole_inputs), and report the model if the layout is "
                "one graphc should run exactly.")


def warn_if_random(compiled) -> bool:
    """True when the plan draws random numbers (then eager cannot draw the same)."""
    from .plan.random_ops import seeded
    random = any(n.target is seeded for p in compiled.programs for n in p.module.graph.nodes)
    if random:
        warn_user("config.set_check_microbatching: the plan has random ops (dropout), which draw "
                  "other numbers than eager; the first step is not compared. Fix: check with "
                  "dropout off (p=0 or model.eval()) for the comparison.")
    return random


def _rank_world() -> Tuple[int, int]:
    return ranks.rank_and_size()


def _gather_inputs(inputs, rank: int, world: int) -> List[torch.Tensor]:
    """Every input's whole (global) value, on rank 0 (on other ranks: []). A plain tensor
    is taken from rank 0's copy; a GlobalTensor split(0) is its parts in placement order."""
    locals_ = [x.to_local() if isinstance(x, GlobalTensor) else x for x in inputs]
    if world == 1:
        return [x.detach().clone() for x in locals_]
    everyone: List[Any] = ranks.current().all_gather_object([x.detach().cpu() for x in locals_])
    if rank != 0:
        return []
    out = []
    for i, x in enumerate(inputs):
        if not isinstance(x, GlobalTensor) or all(s == _broadcast() for s in _sbps(x)):
            src = x.placement.flat_ranks[0] if isinstance(x, GlobalTensor) else 0
            out.append(everyone[src][i])
            continue
        sbps = _sbps(x)
        if len(sbps) != 1 or getattr(sbps[0], "dim", None) != 0:
            raise GraphcError(f"config.set_check_microbatching: input {i} is laid out as {x.sbp} on "
                              f"{x.placement}; the check gathers inputs split(0) over a 1-D placement "
                              "or broadcast. Fix: switch the check off for this layout.")
        out.append(torch.cat([everyone[r][i] for r in x.placement.flat_ranks], 0))
    return out


def _sbps(x: GlobalTensor) -> tuple:
    return tuple(x.sbp) if isinstance(x.sbp, (tuple, list)) else (x.sbp,)


def _broadcast():
    from .placement import sbp
    return sbp.broadcast


def optimizer_groups(graph) -> List[Tuple[Dict[str, Any], List[str]]]:
    """The optimizer's groups as (hyperparameters, parameter names), taken before the
    optimizer is trimmed to this rank's parameters."""
    opt = graph._optimizer
    if opt is None:
        return []
    names = {id(p): n for n, p in graph._root.named_parameters(remove_duplicate=False)}
    return [({k: copy.deepcopy(v) for k, v in g.items() if k != "params"},
             [names[id(p)] for p in g["params"] if id(p) in names]) for g in opt.param_groups]


def _eager_root(graph, state: Dict[str, torch.Tensor]) -> nn.Module:
    """A root like the traced one, holding copies of the user's modules with `state`."""
    root = type(graph._root)()
    for name, module in graph._root._modules.items():
        root.add_module(name, copy.deepcopy(module))
    object.__setattr__(root, "_graphc_graph", graph)  # build() reads Graph attributes through it
    prefix = user_prefix(graph._root)
    # assign: a split parameter of this rank holds its shard; the copy takes the whole value
    root.load_state_dict({prefix + k: v.clone() for k, v in state.items()}, assign=True)
    return root


def _first_scalar(out) -> Optional[torch.Tensor]:
    """The first 0-dim floating value in build()'s outputs (its loss), or None."""
    items = pytree.tree_leaves(out, is_leaf=lambda x: isinstance(x, GlobalTensor))
    for o in items:
        t = o.to_local() if isinstance(o, GlobalTensor) else o
        if isinstance(t, torch.Tensor) and t.dim() == 0 and torch.is_floating_point(t):
            return t.detach()
    return None
