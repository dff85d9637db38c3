"""Model-state bytes per rank: parameters, gradients and optimizer state, from the plan.

NOTE: Model-state bytes
A rank's model state (`RankSummary.model_state`) counts what the runtime allocates for its
stages' parameters (See NOTE: ZeRO in graphc/runtime/zero.py for the layouts):
  * params: held between steps. Whole (this rank's component under tensor parallel), except
    a ZeRO stage-3 parameter (one a REDUCE_SCATTER names, plan note `zero: stage 3`): only
    this rank's rows, torch.chunk's (its whole storage is freed between uses);
  * grads: the gradient storage a rank holds at its optimizer step: each ALL_REDUCE and
    TIE_ALL_REDUCE bucket whole (a flat buffer in the reduce dtype, kept between steps, plus
    its copy in the gradients' dtype where that differs), each REDUCE_SCATTER bucket's
    summed part (every tensor padded to its largest chunk, in the reduce dtype), at ZeRO
    stage 1 instead its packed bucket (d parts, kept between steps, the summed part written
    into this rank's; with a reduce dtype of its own also the part), and a trained parameter
    no collective names (no data parallelism) whole in its own dtype;
  * optimizer: the state tensors of a parameter's shape that the optimizer keeps for each
    trained parameter (Adam 2, SGD with momentum 1), on this rank's rows for one a
    REDUCE_SCATTER names (ZeRO 1, 2, 3), else whole. Scalars (Adam's step) are not counted.
Buffers and gathered stage-3 parameters (whole only during the step) are not model state.
tests/zero/test_zero_model_state.py checks these against the tensors on real ranks.
"""
from __future__ import annotations

import collections.abc
import math
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ...meta import META_SBP, META_TENSOR, SbpSignature
from ...plan.instructions import AllReduce, ReduceScatter, TieAllReduce
from ...plan.plan import ZERO_NOTE, ExecutionPlan
from ...sbp.layout import chunk_range, local_shape

ASSUMED_STATES = 2      # without the optimizer: Adam's exp_avg and exp_avg_sq


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as a rank holds it: every name it goes by (a tied one has several),
    this rank's component's shape, its dtype, whether it is trained (has a gradient) and how
    many optimizer state tensors of its shape it gets."""

    names: Tuple[str, ...]
    shape: Tuple[int, ...]
    dtype: str
    trained: bool
    states: int

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class ModelInputs:
    """What model-state bytes need beyond the plans: each rank's parameters, and a line
    saying where the optimizer's state count came from."""

    params: Mapping[int, Sequence[ParamSpec]]
    optimizer: str
    batch: Mapping[int, int] = field(default_factory=dict)   # rank -> bytes of the inputs it reads


@dataclass(frozen=True)
class ModelState:
    """A rank's model-state bytes (See NOTE: Model-state bytes)."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def model_state(plan: ExecutionPlan, params: Sequence[ParamSpec]) -> ModelState:
    """The model-state bytes of `plan`'s rank holding `params` (NOTE: Model-state bytes)."""
    by_name = {n: p for p in params for n in p.names}
    stage = zero_stage(plan) if plan.training else 0
    grads, rows, reduced = _gradient_buffers(plan, by_name, stage) if plan.training else (0, {}, set())
    out_params = out_optim = 0
    for p in {id(p): p for p in params}.values():      # a tied parameter once
        r = rows.get(id(p))
        out_params += r * p.row_bytes if r is not None and stage == 3 else p.nbytes
        if p.trained and plan.training:
            out_optim += p.states * (r * p.row_bytes if r is not None else p.nbytes)
            if id(p) not in reduced:                     # no collective: its own gradient
                grads += p.nbytes
    return ModelState(out_params, grads, out_optim)


def _gradient_buffers(plan: ExecutionPlan, by_name: Dict[str, ParamSpec], stage: int):
    """(bytes of the gradient collectives' buffers, id(parameter) -> this rank's rows for each
    sharded one, the ids of the parameters some collective reduces)."""
    grads, rows, reduced = 0, {}, set()
    for ins in plan.instructions:
        if type(ins) is ReduceScatter:   # by exact class, as the branch below
            d, k = len(ins.ranks), sorted(ins.ranks).index(plan.rank)
            part = 0
            for t in ins.tensors:
                p = by_name[t.name]
                rows[id(p)] = chunk_range(p.shape[0], d, k)[1]
                part += -(-p.shape[0] // d) * math.prod(t.shape[1:]) * _itemsize(t.dtype)
                if t.dtype != p.dtype:      # the sum cast back to the gradient's dtype
                    part += rows[id(p)] * p.row_bytes
                reduced.add(id(p))
            # stage 1 keeps the packed d parts; the shards' gradients are views of this rank's
            # (runtime/zero_sync.py ZeroGradSync.wait) unless the sum is cast to another dtype
            same = all(t.dtype == by_name[t.name].dtype for t in ins.tensors)
            grads += part * ((d if same else d + 1) if stage == 1 else 1)
        elif type(ins) in (AllReduce, TieAllReduce):
            names = ins.params if isinstance(ins, TieAllReduce) else [t.name for t in ins.tensors]
            names = [n for n in names if n in by_name]   # a tie names its other stages' names too
            grads += sum(t.nbytes for t in ins.tensors)
            wide = by_name[names[0]].dtype if names else None
            if wide is not None and ins.tensors and ins.tensors[0].dtype != wide:
                grads += sum(math.prod(t.shape) for t in ins.tensors) * _itemsize(wide)
            reduced |= {id(by_name[n]) for n in names}
    return grads, rows, reduced


def zero_stage(plan: ExecutionPlan) -> int:
    """The ZeRO stage of a plan (its `zero: stage N; ...` note), 0 without ZeRO."""
    note = plan.notes.get(ZERO_NOTE)
    return int(note.split(";")[0].split()[1]) if note else 0


def model_inputs(compiled, optimizer=None) -> ModelInputs:
    """Every rank's ParamSpecs from the compiled stage programs (plan mode's whole parameters
    or a running rank's own, alike: shapes come from the traced graph), with the optimizer's
    state tensors per parameter counted on a small copy of it (None: Adam's 2 assumed)."""
    states, note = _state_counts(optimizer)
    per_stage: Dict[int, List[Tuple[int, _StageParam]]] = {}
    for prog in compiled.programs:
        per_stage[prog.stage] = _stage_params(prog.module, states)
    return ModelInputs(_ParamsByRank(compiled.plans, per_stage), note, batch_bytes(compiled))


class _ParamsByRank(collections.abc.Mapping):
    """rank -> its ParamSpecs, worked out when first asked: a simulation of a world of plan
    templates asks for its templates' only (NOTE: Simulated classes, tools/simulate/classes.py)."""

    def __init__(self, plans, per_stage):
        self._per_stage, self._known = per_stage, {}
        if hasattr(plans, "plan_or_template"):   # a rank's stages are its template's: no instance made
            self._ranks, self._plan_of = range(len(plans)), plans.plan_or_template
        else:
            by_rank = {p.rank: p for p in plans}
            self._ranks, self._plan_of = by_rank.keys(), by_rank.__getitem__

    def __getitem__(self, rank: int) -> List[ParamSpec]:
        if rank not in self._known:
            if rank not in self._ranks:
                raise KeyError(rank)
            seen: Dict[int, ParamSpec] = {}
            for s in self._plan_of(rank).local_stages:
                for key, param in self._per_stage.get(s, ()):
                    if key not in seen:
                        seen[key] = param.on(rank)
            self._known[rank] = list(seen.values())
        return self._known[rank]

    def __iter__(self):
        return iter(self._ranks)

    def __len__(self) -> int:
        return len(self._ranks)


def batch_bytes(compiled) -> Dict[int, int]:
    """rank -> bytes of the user's inputs its stages read, whole for the step (a rank holds its
    component of the batch while the step runs; its micro-batches are views of it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from ..stage_inputs import stage_inputs
    m = compiled.plans[0].num_microbatches if compiled.plans else 1
    per_stage: Dict[int, Dict[str, int]] = {}
    with FakeTensorMode():
        for prog in compiled.programs:
            one = stage_inputs(prog, compiled)
            per_stage[prog.stage] = {
                n: one[n].nbytes * (1 if n in prog.whole_inputs or one[n].dim() == 0 else m)
                for n in prog.user_inputs}
    out = {}
    for rank, stages in _local_stages(compiled.plans):
        names: Dict[str, int] = {}
        for s in stages:
            names.update(per_stage.get(s, {}))
        out[rank] = sum(names.values())
    return out


def _local_stages(plans):
    """(rank, its stages) for every rank; a world of templates reads them off the templates
    (NOTE: Simulated classes), once per template: no instance is made, and a stage's ranks
    are not scanned again for every rank of a class."""
    if not hasattr(plans, "plan_or_template"):
        return ((p.rank, p.local_stages) for p in plans)
    held: Dict[int, List[int]] = {}     # id(template) -> its stages

    def stages_of(plan) -> List[int]:
        if id(plan) not in held:
            held[id(plan)] = plan.local_stages
        return held[id(plan)]
    return ((r, stages_of(plans.plan_or_template(r))) for r in range(len(plans)))


@dataclass(frozen=True)
class _StageParam:
    """A parameter as a stage program holds it: its global shape and layout (None: whole)."""

    names: Tuple[str, ...]
    shape: Tuple[int, ...]
    sig: Optional[SbpSignature]
    dtype: str
    trained: bool
    states: int

    def on(self, rank: int) -> ParamSpec:
        local = self.shape if self.sig is None else tuple(
            local_shape(self.shape, self.sig.out, self.sig.mesh, rank))
        return ParamSpec(self.names, local, self.dtype, self.trained, self.states)


def _stage_params(module, states) -> List[Tuple[int, _StageParam]]:
    """(id(parameter), its _StageParam) for each parameter of a stage program; shape and
    layout from its get_attr node (a running rank's parameter may be its shard already)."""
    nodes = {str(n.target): n for n in module.graph.nodes if n.op == "get_attr"}
    names: Dict[int, List[str]] = {}
    objs: Dict[int, torch.nn.Parameter] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        objs[id(p)] = p
    out = []
    for key, ns in names.items():
        p = objs[key]
        node = next((nodes[n] for n in ns if n in nodes), None)
        meta = node.meta.get(META_TENSOR) if node is not None else None
        sig = node.meta.get(META_SBP) if node is not None else None
        count = states.get(key, states.get(None, 0)) if p.requires_grad else 0
        out.append((key, _StageParam(tuple(ns), tuple(meta.shape) if meta is not None else tuple(p.shape),
                                     sig, str(p.dtype).replace("torch.", ""), p.requires_grad, count)))
    return out


def _state_counts(optimizer) -> Tuple[Dict[Optional[int], int], str]:
    """id(parameter) -> optimizer state tensors of its shape (key None: any parameter), and
    where the count came from."""
    if optimizer is None:
        return {None: ASSUMED_STATES}, (f"optimizer unknown: Adam's {ASSUMED_STATES} state "
                                        "tensors per parameter assumed")
    counts: Dict[Optional[int], int] = {}
    # a running ZeRO graph's groups hold shard parameters in place of its own (See NOTE: ZeRO
    # in graphc/runtime/zero.py): each counts for the parameter it shards
    whole = {id(shard): key for key, shard in getattr(optimizer, "_graphc_zero_shards", {}).items()}
    try:
        for group in optimizer.param_groups:
            n = _probe(optimizer, group)
            counts.update({whole.get(id(p), id(p)): n for p in group["params"]})
    except Exception as exc:   # an optimizer a copy cannot step alone (LBFGS needs a closure)
        return {None: ASSUMED_STATES}, (f"{type(optimizer).__name__} could not be probed "
                                        f"({type(exc).__name__}): Adam's {ASSUMED_STATES} state "
                                        "tensors per parameter assumed")
    shown = sorted(set(counts.values()))
    return counts, (f"{type(optimizer).__name__}: {'/'.join(map(str, shown)) or 0} state "
                    "tensor(s) per parameter, counted on a copy of the graph's optimizer")


def _probe(optimizer, group) -> int:
    """The state tensors of a parameter's shape one step of `optimizer`'s type, with the
    group's settings, leaves for a small parameter."""
    p = torch.nn.Parameter(torch.zeros(2, 3))
    p.grad = torch.ones_like(p)
    settings = {k: v for k, v in group.items() if k != "params"}
    copy = type(optimizer)([dict(settings, params=[p])])
    copy.step()
    return sum(1 for v in copy.state[p].values() if torch.is_tensor(v) and v.shape == p.shape)


def _itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize
