"""Check mode's comparison of every graph call with an eager twin (`graphc check`,
graphc.testing.local_world(check=True); the setting is graphc/modes.py).

NOTE: Checked steps
In check mode every call of a graph is compared, not only the first: rank 0 keeps an
EagerTwin (graphc/checking/first_step.py: a copy of the model, of the optimizer with the same
hyperparameters and of the LR scheduler, made from the graph's state before its first
step) and steps it on the whole batch after each graphc step, then compares the loss and
every parameter (gathered with full_state_dict). The twin goes on from its own state, so a
difference that grows over steps shows as it grows. The first departing step names its
parameter and its first departing value: every rank kept each Forward's outputs of the
step (Runtime.captured), which are gathered then, and only then, and compared with the
twin's module outputs on the same rows (_locate). Every rank gets the step's verdict.
A job with config.enable_amp has its twin run build() under the same autocast (backward
outside it, EagerTwin._amp), compared at the amp dtype's tolerance (first_step.amp_bound).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from .. import modes, world as ranks
from ..modes import CheckDone
from .first_step import (EagerTwin, FirstStepCheck, _first_scalar, _rank_world, amp_bound, gathered_loss,
                         optimizer_groups, user_prefix, warn_if_random, whole_batch)
from ..placement import Broadcast, Split
from ..runtime.local_world import sum_in_order
from ..sbp.layout import flat


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
        self.graph, self.groups, self.bound = graph, groups, amp_bound(graph, bound)
        self.twin: Optional[EagerTwin] = None
        self.report: Optional[StepReport] = None
        self.inputs: List[torch.Tensor] = []
        self.tree = None
        self.rank, self.world = 0, 1
        self.boundaries = None   # (compiled, its _boundary_modules)

    def start(self, inputs: Tuple[Any, ...]) -> None:
        """Before graphc's step (compiled): the whole batch; the twin on the first call."""
        self.rank, self.world = _rank_world()
        self.inputs, self.tree = whole_batch(inputs, self.rank, self.world)
        runtime = self.graph._runtime
        if runtime is not None and runtime.captured is None:
            runtime.captured = []   # each Forward's outputs (NOTE: Checked steps)
        if self.report is None:
            before = self.graph.full_state_dict(rank0_only=True)
            if self.rank == 0:
                self.twin = EagerTwin(self.graph, self.groups, before)
            # the bound the parameters are compared at (their dtype's; an amp job's: amp_bound)
            shown = next((v.dtype for v in before.values() if torch.is_floating_point(v)), torch.float64)
            self.report = StepReport(type(self.graph).__name__, self.world, bound=self.bound(shown))
            self.report.where = _holders(self.graph)

    def compare(self, outputs) -> StepRow:
        """After graphc's step: rank 0 steps the twin and compares; every rank gets the row.
        On the first departing step the ranks' Forward outputs are gathered to name the
        first departing value."""
        after = self.graph.full_state_dict(rank0_only=True)
        got = gathered_loss(outputs, self.world)
        first = not any(r.bad for r in self.report.rows)
        boundary = self._boundary() if first else {}
        row = None
        if self.rank == 0:
            out, want = self.twin.step(self.inputs, self.tree, {q for q, _ in boundary.values()})
            row = self._row(len(self.report.rows), got, _first_scalar(out), after, want)
        if self.world > 1:
            row = ranks.current().broadcast_object(row, src=0)
        if first and row.bad:
            captured = self._captured()
            if self.rank == 0:
                row.origin = _locate(self.graph._compiled, captured, boundary, self.twin.seen, self.bound)
            if self.world > 1:
                row.origin = ranks.current().broadcast_object(row.origin, src=0)
        self.report.rows.append(row)
        return row

    def _boundary(self) -> Dict[str, Tuple[str, Optional[int]]]:
        """_boundary_modules of the current plan, once per compiled plan."""
        compiled = self.graph._compiled
        if self.boundaries is None or self.boundaries[0] is not compiled:
            self.boundaries = (compiled, _boundary_modules(compiled))
        return self.boundaries[1]

    def _captured(self) -> list:
        """Every rank's Forward outputs of this step, by rank (collective)."""
        runtime = self.graph._runtime
        mine = list(runtime.captured) if runtime is not None and runtime.captured is not None else []
        if self.world == 1:
            return [mine]
        return ranks.current().all_gather_object(
            [(label, s, mb, {n: v.cpu() for n, v in vals.items()}) for label, s, mb, vals in mine])

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
    from ..meta import META_ROWS, META_SBP
    from ..sbp.layout import local_component
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
                value = sum_in_order([by_rank[name][(s, mb, q)] for q in members])
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



class StepChecks:
    """A call's comparisons with eager PyTorch: the first step's (config.check_microbatching,
    NOTE: Checked first step) and, in check mode, every step's (NOTE: Checked steps)."""

    def __init__(self, graph, first: Optional[FirstStepCheck], checking):
        self.graph, self.first, self.checking = graph, first, checking
        self.checker: Optional[StepChecker] = None

    @staticmethod
    def before_call(graph) -> "StepChecks":
        """Made before the call compiles: the eager twins copy the model and the optimizer's
        groups as they are before the first compile takes them over."""
        first, checking = None, modes.active_check()
        if graph._compiled is None:
            if graph.config.check_microbatching:
                first = FirstStepCheck(graph, optimizer_groups(graph))
            if checking is not None and graph._checker is None:
                object.__setattr__(graph, "_checker", StepChecker(graph, optimizer_groups(graph), checking.bound))
        return StepChecks(graph, first, checking)

    def start(self, inputs) -> None:
        """Once compiled, before the step: the twins take the call's inputs."""
        graph, checking = self.graph, self.checking
        self.first = self.first if self.first is not None and not warn_if_random(graph._compiled) else None
        if self.first is not None:
            self.first.start(inputs)
        self.checker = graph._checker if checking is not None else None
        if self.checker is not None:
            self.checker.start(inputs)
            if self.checker.report not in checking.reports and graph._rank == 0:
                checking.reports.append(self.checker.report)

    def compare(self, outputs) -> None:
        """After the step: graphc's against eager's; check mode ends after its steps."""
        if self.first is not None:
            self.first.compare(outputs)
        if self.checker is not None:
            self.checker.compare(outputs)
            rows = len(self.checker.report.rows)
            if self.checking.steps is not None and rows >= self.checking.steps:
                raise CheckDone(f"{type(self.graph).__name__}: {rows} step(s) checked")
