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

import contextlib
import copy
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .. import world as ranks
from ..checkpoint.dcp import user_prefix
from ..errors import GraphcError
from ..global_tensor import GlobalTensor
from ..log import warn_user
from ..modes import tolerance
from ..placement import Broadcast, Split
from ..sbp.layout import coord, flat, place_shard



def amp_bound(graph, bound: Callable[[torch.dtype], float]) -> Callable[[torch.dtype], float]:
    """`bound` (a tolerance by the compared values' dtype) for this graph's job. With
    config.enable_amp the float32 parameters and loss are computed through the amp dtype's
    roundings, which graphc cuts elsewhere than eager on the whole batch does (micro-batches,
    shards, partial sums), so they agree to the amp dtype's tolerance, not float32's (eager
    autocast itself moves that much when cut differently: benchmarks/amp_noise_floor.py).
    float64 values keep theirs: autocast leaves float64 ops as they are."""
    amp = graph.config.amp_dtype
    if amp is None:
        return bound
    return lambda dtype: bound(dtype) if dtype == torch.float64 else max(bound(dtype), bound(amp))


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
        self.inputs, self.tree = whole_batch(inputs, self.rank, self.world)
        self.before = self.graph.full_state_dict(rank0_only=True)

    def compare(self, outputs) -> None:
        """After graphc's step: rank 0 runs eager and compares; every rank gets the verdict."""
        graph = self.graph
        after = graph.full_state_dict(rank0_only=True)
        loss = gathered_loss(outputs, self.world)
        report = ""
        if self.rank == 0:
            report = self._run_eager_and_compare(after, loss)
        if self.world > 1:
            report = ranks.current().broadcast_object(report, src=0)
        if report:
            raise GraphcError(report)

    def _run_eager_and_compare(self, after: Dict[str, torch.Tensor], loss: Optional[float]) -> str:
        graph = self.graph
        out, want = EagerTwin(graph, self.groups, self.before).step(self.inputs, self.tree)
        want_loss = _first_scalar(out)
        prefix = user_prefix(graph._root)  # full_state_dict's keys drop it; the report names it
        rtol = amp_bound(graph, lambda dtype: tolerance(dtype).first_step)
        rows = []
        for k, v in want.items():
            got = after.get(k)
            if got is None or not torch.is_floating_point(v):
                continue
            diff = (got.to(v.dtype) - v).abs().max().item() if v.numel() else 0.0
            scale = max(v.abs().max().item() if v.numel() else 0.0, 1.0)
            if diff > rtol(v.dtype) * scale:
                rows.append((diff, prefix + k))
        dloss = None
        if loss is not None and want_loss is not None:
            dloss = abs(loss - float(want_loss))
            tol = rtol(want_loss.dtype) * max(abs(float(want_loss)), 1.0)
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
    from ..ops.random_ops import seeded
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
    is taken from rank 0's copy; a GlobalTensor is put together from its holders' local
    components (split or broadcast on any mesh; the first rank along broadcast axes)."""
    locals_ = [x.to_local() if isinstance(x, GlobalTensor) else x for x in inputs]
    if world == 1:
        return [x.detach().clone() for x in locals_]
    everyone: List[Any] = ranks.current().all_gather_object([x.detach().cpu() for x in locals_])
    if rank != 0:
        return []
    out = []
    for i, x in enumerate(inputs):
        if not isinstance(x, GlobalTensor):
            out.append(everyone[0][i])
            continue
        sbps, mesh = _sbps(x), x.placement.ranks
        if any(not isinstance(s, (Split, Broadcast)) for s in sbps):
            raise GraphcError(f"the eager check: input {i} is laid out as {x.sbp} on {x.placement}; "
                              "the check puts inputs together from split and broadcast parts only. "
                              "Fix: pass that input split or broadcast, or switch the check off.")
        full = torch.empty(tuple(x.shape), dtype=everyone[0][i].dtype)
        for r in flat(mesh):
            if all(d == 0 for d, s in zip(coord(mesh, r), sbps) if not isinstance(s, Split)):
                place_shard(full, everyone[r][i], sbps, mesh, r)
        out.append(full)
    return out


def _sbps(x: GlobalTensor) -> tuple:
    return tuple(x.sbp) if isinstance(x.sbp, (tuple, list)) else (x.sbp,)


def _broadcast():
    from ..placement import sbp
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
    """A root like the traced one, holding copies of the user's modules with `state` (the
    full, unprefixed state dict): each parameter and buffer object takes its whole value
    once, so tied ones stay tied and split ones (this rank's shard) become whole."""
    root = type(graph._root)()
    for name, module in graph._root._modules.items():
        root.add_module(name, copy.deepcopy(module))
    object.__setattr__(root, "_graphc_graph", graph)  # build() reads Graph attributes through it
    prefix = user_prefix(graph._root)
    done = set()
    for k, t in root.state_dict(keep_vars=True).items():
        key = k[len(prefix):] if prefix and k.startswith(prefix) else k
        if id(t) in done or key not in state:
            continue
        done.add(id(t))
        t.data = state[key].to(t.dtype).clone()
    return root


def _first_scalar(out) -> Optional[torch.Tensor]:
    """The first 0-dim floating value in build()'s outputs (its loss), or None."""
    items = pytree.tree_leaves(out, is_leaf=lambda x: isinstance(x, GlobalTensor))
    for o in items:
        t = o.to_local() if isinstance(o, GlobalTensor) else o
        if isinstance(t, torch.Tensor) and t.dim() == 0 and torch.is_floating_point(t):
            return t.detach()
    return None


class EagerTwin:
    """Rank 0's eager copy of a graph: model, optimizer and LR scheduler, one step per call."""

    def __init__(self, graph, groups, state: Dict[str, torch.Tensor]):
        self.graph = graph
        self.root = _eager_root(graph, state)
        self.opt = None
        self.sch = None
        if graph._optimizer is not None and groups:
            params = dict(self.root.named_parameters(remove_duplicate=False))
            self.opt = type(graph._optimizer)(
                [dict(opts, params=[params[n] for n in names if n in params]) for opts, names in groups])
            if graph._lr_scheduler is not None:  # its counters and lambdas, stepping the twin's optimizer
                self.sch = copy.deepcopy(graph._lr_scheduler, {id(graph._optimizer): self.opt})

    def _amp(self):
        """config.enable_amp as the compiled step means it: build() under torch.autocast on the
        device the twin runs on, loss.backward() outside it (NOTE: Autocast regions)."""
        dtype = self.graph.config.amp_dtype
        if dtype is None:
            return contextlib.nullcontext()
        device_type = next((p.device.type for p in self.root.parameters()), "cpu")
        return _AmpBuild(device_type, dtype)

    def _keeper(self, qualname: str):
        """A forward hook keeping a copy of the module's (first) output; it returns None: a
        hook's return value would replace the output (and a detached copy cut the backward)."""
        def keep(module, args, out) -> None:
            if qualname not in self.seen:
                self.seen[qualname] = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), out)
        return keep

    def step(self, inputs: List[torch.Tensor], tree, watch=()) -> Tuple[Any, Dict[str, torch.Tensor]]:
        """build() eagerly on the whole batch, then the optimizer and scheduler steps. The
        outputs of the modules named in `watch` (qualified names) are kept in `self.seen`."""
        if self.opt is not None:
            self.opt.zero_grad(set_to_none=True)
        self.seen: Dict[str, Any] = {}
        hooks = []
        for qualname in watch:
            try:
                module = self.root.get_submodule(qualname)
            except AttributeError:
                continue
            hooks.append(module.register_forward_hook(self._keeper(qualname)))
        try:
            with self._amp():
                out = type(self.graph).build(self.root, *pytree.tree_unflatten(inputs, tree))
        finally:
            for h in hooks:
                h.remove()
        if self.opt is not None:
            self.opt.step()
            if self.sch is not None:
                with warnings.catch_warnings():  # the copy's optimizer.step carries no scheduler wrapper
                    warnings.filterwarnings("ignore", message="Seems like `optimizer.step", category=UserWarning)
                    self.sch.step()
        prefix = user_prefix(self.graph._root)
        state = {k[len(prefix):] if prefix and k.startswith(prefix) else k: v.detach()
                 for k, v in self.root.state_dict().items()}
        return out, state


class _AmpBuild(TorchFunctionMode):
    """build() under torch.autocast(device_type, dtype), with Tensor.backward() run outside
    it, as graphc's executor runs the backward (config.enable_amp)."""

    def __init__(self, device_type: str, dtype: torch.dtype):
        super().__init__()
        self.autocast = torch.autocast(device_type, dtype=dtype)
        self.device_type = device_type

    def __enter__(self):
        self.autocast.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self.autocast.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.backward:
            with torch.autocast(self.device_type, enabled=False):
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def whole_batch(inputs: Tuple[Any, ...], rank: int, world: int) -> Tuple[List[torch.Tensor], Any]:
    """(every input leaf's whole value on rank 0, their tree): what the eager copy is fed."""
    is_leaf = lambda x: isinstance(x, GlobalTensor)  # noqa: E731 - one input each
    leaves, tree = pytree.tree_flatten(tuple(inputs), is_leaf=is_leaf)  # NOTE: Input trees
    return _gather_inputs(leaves, rank, world), tree


def gathered_loss(outputs, world: int) -> Optional[float]:
    """The step's loss (build()'s first scalar), from whichever rank computed it."""
    loss = _first_scalar(outputs)
    losses = [None if loss is None else float(loss)]
    if world > 1:
        losses = ranks.current().all_gather_object(losses[0])
    return next((x for x in losses if x is not None), None)
