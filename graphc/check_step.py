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
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from . import world as ranks
from .dcp import user_prefix
from .errors import GraphcError
from .global_tensor import GlobalTensor
from .log import warn_user
from .placement import Broadcast, Split
from .sbp.layout import coord, flat, place_shard

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
            params = dict(root.named_parameters(remove_duplicate=False))
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
    from .ops.random_ops import seeded
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


# NOTE: Checked steps
# In check mode (graphc/check_mode.py: `graphc check`, graphc.testing.check) every call of a
# graph is compared, not only the first: rank 0 keeps an EagerTwin (a copy of the model, of
# the optimizer with the same hyperparameters and of the LR scheduler, made from the
# graph's state before its first step) and steps it on the whole batch after each graphc
# step, then compares the loss and every parameter (gathered with full_state_dict). The twin
# goes on from its own state, so a difference that grows over steps shows as it grows, and
# the first step and parameter that depart are named. Every rank gets the step's verdict.
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


@dataclass
class StepRow:
    """One checked step: graphc's and eager's loss, and the largest parameter difference."""

    step: int
    loss: Optional[float]
    eager_loss: Optional[float]
    dloss: float
    dparam: float
    worst: str             # the parameter with the largest difference ("" without parameters)
    bad: List[str]         # every value beyond the tolerance this step ("<loss>" for the loss)
    origin: str = ""       # where the step's values first depart (see StepChecker._locate)


@dataclass
class StepReport:
    """A graph's checked steps against eager (rank 0's; see NOTE: Checked steps)."""

    graph: str
    world: int
    rows: List[StepRow] = field(default_factory=list)
    per_param: Dict[str, float] = field(default_factory=dict)   # name -> max |difference| over steps
    where: Dict[str, str] = field(default_factory=dict)         # name -> stage and ranks holding it
    bound: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.rows) and not any(r.bad for r in self.rows)

    @property
    def first_departure(self) -> Optional[Tuple[int, str]]:
        for r in self.rows:
            if r.bad:
                return r.step, r.bad[0]
        return None

    def text(self) -> str:
        lines = [f"{self.graph} on {self.world} rank(s) vs eager PyTorch on the whole batch "
                 f"(bound |d| <= {self.bound:g} * (1 + |eager|)):",
                 f"  {'step':>4}  {'loss':>22}  {'eager loss':>22}  {'|dloss|':>9}  {'max |dparam|':>12}  parameter"]
        for r in self.rows:
            lines.append(f"  {r.step:>4}  {_fmt(r.loss):>22}  {_fmt(r.eager_loss):>22}  {r.dloss:9.2e}  "
                         f"{r.dparam:12.2e}  {r.worst}{'  <- differs' if r.bad else ''}")
        first = self.first_departure
        if first is None:
            lines.append(f"  OK: {len(self.rows)} step(s), {len(self.per_param)} parameter(s) agree.")
        else:
            step, name = first
            holder = f" ({self.where[name]})" if name in self.where else ""
            lines.append(f"  DIFFERS: first at step {step}, {name}{holder}")
            origin = self.rows[step].origin if step < len(self.rows) else ""
            if origin:
                lines.append(f"  first departing value: {origin}")
            lines.append("  largest difference per parameter:")
            worst = sorted(self.per_param.items(), key=lambda kv: -kv[1])[:8]
            lines += [f"    {name}: {d:.3g}" + (f"  ({self.where[name]})" if name in self.where else "")
                      for name, d in worst]
        return "\n".join(lines)


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.17g}"


class StepChecker:
    """Compares every call of one graph with its EagerTwin (NOTE: Checked steps)."""

    def __init__(self, graph, groups, bound):
        self.graph, self.groups, self.bound = graph, groups, bound
        self.twin: Optional[EagerTwin] = None
        self.report: Optional[StepReport] = None
        self.inputs: List[torch.Tensor] = []
        self.tree = None
        self.rank, self.world = 0, 1

    def start(self, inputs: Tuple[Any, ...]) -> None:
        """Before graphc's step (compiled): the whole batch; the twin on the first call."""
        self.rank, self.world = _rank_world()
        is_leaf = lambda x: isinstance(x, GlobalTensor)  # noqa: E731 - one input each
        leaves, self.tree = pytree.tree_flatten(tuple(inputs), is_leaf=is_leaf)
        self.inputs = _gather_inputs(leaves, self.rank, self.world)
        runtime = self.graph._runtime
        if runtime is not None and runtime.captured is None:
            runtime.captured = []   # each Forward's outputs (NOTE: Checked steps)
        if self.report is None:
            before = self.graph.full_state_dict(rank0_only=True)
            if self.rank == 0:
                self.twin = EagerTwin(self.graph, self.groups, before)
            self.report = StepReport(type(self.graph).__name__, self.world, bound=self.bound(torch.float64))
            self.report.where = _holders(self.graph)

    def compare(self, outputs) -> Optional[StepRow]:
        """After graphc's step: rank 0 steps the twin and compares; every rank gets the row."""
        after = self.graph.full_state_dict(rank0_only=True)
        loss = _first_scalar(outputs)
        losses = [None if loss is None else float(loss)]
        if self.world > 1:
            losses = ranks.current().all_gather_object(losses[0])
        got = next((x for x in losses if x is not None), None)
        runtime = self.graph._runtime
        mine = list(runtime.captured) if runtime is not None and runtime.captured is not None else []
        captured = [mine] if self.world == 1 else ranks.current().all_gather_object(
            [(label, s, mb, {n: v.cpu() for n, v in vals.items()}) for label, s, mb, vals in mine])
        row = None
        if self.rank == 0:
            boundary = _boundary_modules(self.graph._compiled)
            out, want = self.twin.step(self.inputs, self.tree, {q for q, _ in boundary.values()})
            row = self._row(len(self.report.rows), got, _first_scalar(out), after, want)
            if row.bad and not any(r.bad for r in self.report.rows):   # the first departing step
                row.origin = _locate(self.graph._compiled, captured, boundary, self.twin.seen, self.bound)
        if self.world > 1:
            row = ranks.current().broadcast_object(row, src=0)
        self.report.rows.append(row)
        return row

    def _row(self, step, got, want_loss, after, want) -> StepRow:
        bad, worst, dparam = [], "", 0.0
        for k, v in want.items():
            g = after.get(k)
            if g is None or not torch.is_floating_point(v) or not v.numel():
                continue
            d = (g.to(v.dtype) - v).abs().max().item()
            self.report.per_param[k] = max(self.report.per_param.get(k, 0.0), d)
            if d >= dparam:
                dparam, worst = d, k
            if d > self.bound(v.dtype) * (1.0 + v.abs().max().item()):
                bad.append((d, k))
        eager = None if want_loss is None else float(want_loss)
        dloss = abs(got - eager) if got is not None and eager is not None else 0.0
        if got is not None and eager is not None and dloss > self.bound(want_loss.dtype) * (1.0 + abs(eager)):
            bad.append((float("inf"), "<loss>"))
        bad.sort(reverse=True)
        return StepRow(step, got, eager, dloss, dparam, worst, [k for _, k in bad])


def _holders(graph) -> Dict[str, str]:
    """parameter name -> 'stage s on ranks [...]' for the report."""
    state = graph._state
    out = {}
    if state is None:
        return out
    for k, stage in getattr(state, "owner", {}).items():
        ranks_of = graph._compiled.stages[stage].ranks
        out[k] = f"stage {graph._compiled.stages[stage].stage_id} on ranks {list(ranks_of)}"
    prefix = user_prefix(graph._root)
    return {k[len(prefix):] if prefix and k.startswith(prefix) else k: v for k, v in out.items()}


def _boundary_modules(compiled) -> Dict[str, Tuple[str, Optional[int]]]:
    """Each value a stage program sends to another stage that is a module's output: name ->
    (the module's qualified name, None). The module is the outermost one the value leaves:
    in its nn_module_stack, and not in that of a user (Llama's residual add at the end of
    model.model.layers.0, read by layers.1)."""
    nodes = {n.name: n for n in compiled.gm.graph.nodes}
    names = {t.name for prog in compiled.programs for specs in prog.send_to.values() for t in specs}
    out: Dict[str, Tuple[str, Optional[int]]] = {}
    for name in sorted(names):
        node = nodes.get(name)
        stack = list((node.meta.get("nn_module_stack") or {}).keys()) if node is not None else []
        users = [set((u.meta.get("nn_module_stack") or {}).keys()) for u in (node.users if node else ())
                 if u.meta.get("nn_module_stack")]
        left = [q for q in stack if any(q not in u for u in users)]
        if left:
            out[name] = (left[0], None)
    return out


def _locate(compiled, captured, boundary, seen, bound) -> str:
    """The first stage output (in stage order, then micro-batch, then rank) whose value
    departs from the eager twin's module output on the same rows; or where to look when every
    one agrees. Split and broadcast values are compared (a partial sum is skipped)."""
    from .meta import META_ROWS, META_SBP
    from .sbp.layout import local_component
    nodes = {n.name: n for n in compiled.gm.graph.nodes}
    m = compiled.num_microbatches
    compared = 0
    by_rank: Dict[str, Dict[tuple, torch.Tensor]] = {}
    for r, caps in enumerate(captured):
        for _, s, mb, vals in caps:
            for name, value in vals.items():
                by_rank.setdefault(name, {})[(s, mb, r)] = value
    entries = sorted(((s, mb, r, label, vals) for r, caps in enumerate(captured) for label, s, mb, vals in caps),
                     key=lambda e: (e[0], e[1], e[2]))
    for s, mb, r, label, vals in entries:
        for name, value in sorted(vals.items()):
            if name not in boundary:
                continue
            qualname, item = boundary[name]
            whole = seen.get(qualname)
            # a module returning several tensors ((cos, sin), (hidden, attn)): the closest item
            candidates = [t for t in pytree.tree_leaves(whole) if isinstance(t, torch.Tensor)]
            node = nodes[name]
            sig, rows = node.meta.get(META_SBP), node.meta.get(META_ROWS)
            if sig is not None and any(not isinstance(p, (Split, Broadcast)) for p in sig.out):
                # a partial sum on a 1-D mesh: its ranks' values add up to the whole (once, on the first)
                members = list(flat(sig.mesh))
                if len(sig.out) != 1 or r != members[0] or any((s, mb, q) not in by_rank.get(name, {})
                                                                for q in members):
                    continue
                value = _sum_in_order([by_rank[name][(s, mb, q)] for q in members])
                sig = None
            wants = []
            for want in candidates:
                if sig is not None:   # this rank's rows (and shard) of the whole batch's value
                    want = local_component(want, tuple(sig.out), sig.mesh, r)
                if m > 1 and rows is not None and rows.dim is not None:
                    want = want.tensor_split(m, rows.dim)[mb]
                if want.shape == value.shape:
                    wants.append(want)
            if not wants:
                continue
            compared += 1
            d, want = min(((value.to(w.dtype) - w).abs().max().item() if w.numel() else 0.0, w) for w in wants)
            if d > bound(want.dtype) * (1.0 + want.abs().max().item()):
                stage = compiled.stages[s].stage_id
                what = f"output of {qualname}" + (f"[{item}]" if item is not None else "")
                return (f"{what} ('{name}'), stage {stage} micro-batch {mb} on rank {r} (instruction "
                        f"{label}): max |difference| {d:.3g} from eager")
    if not compared:
        return ""
    return (f"the {compared} stage output(s) compared agree with eager, so the step departs "
            "inside a stage's backward, the gradient reduction or the optimizer step")


def _sum_in_order(values: List[torch.Tensor]) -> torch.Tensor:
    total = values[0].clone()
    for v in values[1:]:
        total = total + v
    return total
