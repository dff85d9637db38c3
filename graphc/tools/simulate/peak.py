"""A rank's predicted peak memory over a step: what it holds, walked instruction by instruction.

NOTE: Peak memory model
`memory_peak(plan, params, costs)` answers "will it fit": the bytes of tensors a rank holds
at the end of each instruction of its plan, and the highest of them, named by instruction.
It starts from what the rank holds between steps (NOTE: Model-state bytes: parameters, the
gradient buffers kept between steps, the optimizer state) and follows what the runtime
allocates and frees (graphc/runtime/executor.py, grad_hooks.py, zero.py):
  * FORWARD keeps its micro-batch's saved activations (CostModel.activation_bytes; only
    the stage's inputs for a checkpointed micro-batch);
  * BACKWARD recomputes a checkpointed micro-batch's activations first, then frees them; the
    first backward of a stage in a step creates its parameters' whole gradients (later
    micro-batches accumulate into them); a trained parameter no collective names also keeps
    a gradient buffer of its size between steps (NOTE: Model-state bytes);
  * ALL_REDUCE / TIE_ALL_REDUCE: the bucket's gradients are summed in the bucket kept between
    steps, and the parameters' own gradients are dropped;
  * REDUCE_SCATTER packs the bucket (every rank's part, padded) and receives this rank's
    summed part; the whole gradients are dropped once packed; the part stays as the shards'
    gradients (stages 2 and 3) until the optimizer step, or is written into the kept packed
    bucket (stage 1);
  * ALL_GATHER: a gather holds its packed buffer (d parts, padded) and this rank's part from
    its launch until it unpacks; at stage 3 the unpacked parameters stay whole until RELEASE;
    at stages 1 and 2 the optimizer step launches every bucket's gather as it steps, so all
    of them are held at the end of OPTIMIZER_STEP;
  * OPTIMIZER_STEP drops the shards' gradients (stages 2 and 3).
Within an instruction the model takes the larger of its start and end (a backward frees a
layer's activations as it creates that layer's gradients), so transients smaller than one
layer's tensors (an op's temporary, the gradient flowing between two layers) are not
counted; tests/tools/test_memory_model.py compares the prediction with the peak measured on
real gloo ranks (the profiler's allocator events) and states the tolerance.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

from ...plan.instructions import (AllGather, AllReduce, Backward, BackwardInput, BackwardWeight,
                                  ClipGradNorm, Forward, OptimizerStep, ReduceScatter,
                                  ReleaseParams, TieAllReduce, UnitGather, UnitRelease)
from ...plan.plan import ExecutionPlan, checkpointed_microbatches
from ...sbp.layout import chunk_range
from ..cost_model import CostModel
from .memory import stage_input_bytes
from .model_state import ParamSpec, model_state, zero_stage


@dataclass(frozen=True)
class MemoryPeak:
    """A rank's predicted memory: held between steps, the step's peak and where it happens."""

    rank: int
    held: int                    # bytes between steps (model state)
    peak: int                    # the step's highest bytes
    at: str                      # the instruction whose end (or inside) holds the peak
    parts: Dict[str, int] = field(default_factory=dict)   # the peak by kind of tensor
    series: Tuple[int, ...] = ()   # bytes held at the end of each instruction, in plan order

    def fits(self, capacity: int) -> bool:
        return self.peak <= capacity


class _Held:
    """Bytes held by kind while the walk goes; the highest total seen and where."""

    def __init__(self, base: Dict[str, int]):
        self.parts = dict(base)
        self.peak, self.at, self.at_parts = self.total, "step start", dict(self.parts)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def add(self, kind: str, nbytes: int) -> None:
        self.parts[kind] = self.parts.get(kind, 0) + nbytes

    def mark(self, where: str, extra: Optional[Dict[str, int]] = None) -> None:
        extra = extra or {}
        total = self.total + sum(extra.values())
        if total > self.peak:
            self.peak, self.at = total, where
            self.at_parts = {k: self.parts.get(k, 0) + extra.get(k, 0)
                             for k in [*self.parts, *(k for k in extra if k not in self.parts)]}   # in a fixed order


def memory_peak(plan: ExecutionPlan, params: Sequence[ParamSpec], costs: CostModel,
                gather_copies: int = 1) -> MemoryPeak:
    """The rank's predicted peak over one steady step (See NOTE: Peak memory model).

    Args:
        plan: the rank's ExecutionPlan.
        params: the rank's ParamSpecs (model_inputs(compiled, optimizer).params[rank]).
        costs: a CostModel with activation_bytes (and input_bytes) per stage.
        gather_copies: extra copies of a gathered bucket the transport makes (gloo's
            all-gather into one tensor copies the gathered parts once: 1; NCCL: 0).
    """
    state = model_state(plan, params)
    stage = zero_stage(plan) if plan.training else 0
    by_name = {n: p for p in params for n in p.names}
    kept = _kept_grad_bytes(plan, stage)
    held = _Held({"parameters": state.params, "optimizer": state.optimizer, "gradient buffers": kept})
    base = held.total
    act, inputs = costs.activation_bytes, stage_input_bytes(plan, costs)
    recomputed = checkpointed_microbatches(plan.checkpointing, plan.num_microbatches)
    grads_of = _stage_grad_bytes(plan, params)
    saved: Dict[Tuple[int, int], int] = {}
    graded: Set[int] = set()
    gathered: Dict[str, int] = {}           # stage 3: whole parameters gathered, until RELEASE
    launched: List[int] = []                # gathers launched by the optimizer step
    series: List[int] = []
    parts: Dict[int, int] = {}              # REDUCE_SCATTER parts kept as shard gradients
    for i, ins in enumerate(plan.instructions):
        label = f"{i}: {ins}"[:80]
        for part in ins.parts:
            if part.runs == Forward.runs:
                key = (part.stage, part.microbatch)
                saved[key] = inputs.get(part.stage, 0) if part.microbatch in recomputed \
                    else act.get(part.stage, 0)
                held.add("activations", saved[key])
                held.mark(label)
            elif part.runs in _BACKWARDS:
                _backward(held, part, label, saved, act, graded, grads_of)
        event = MEMORY_EVENTS.get(type(ins))
        if event == "scatter":
            whole = sum(_grad_bytes(by_name[t.name]) for t in ins.tensors)
            padded = ins.padded_nbytes
            part_bytes = padded // len(ins.ranks)
            held.mark(label, {"communication": padded + part_bytes})
            held.add("gradients", -whole)
            if stage != 1:
                parts[i] = part_bytes
                held.add("gradients", part_bytes)
        elif event == "reduce":
            held.mark(label)
            held.add("gradients", -sum(_grad_bytes(by_name[t.name]) for t in ins.tensors
                                       if t.name in by_name))
        elif event == "step":
            if stage in (1, 2):
                for g in (x for x in plan.instructions if isinstance(x, AllGather)):
                    buf = _gather_buffer(g, gather_copies)
                    launched.append(buf)
                    held.add("communication", buf)
                    held.mark(label)
            parts.clear()
            held.mark(label)
            held.add("gradients", -held.parts.get("gradients", 0))   # zero_grad(set_to_none)
        elif event == "gather":
            if stage == 3:
                buf = _gather_buffer(ins, gather_copies)
                whole = {t.name: by_name[t.name].nbytes - _rows_bytes(by_name[t.name], ins, plan.rank)
                         for t in ins.tensors}
                held.mark(label, {"communication": buf, "gathered parameters": sum(whole.values())})
                gathered.update(whole)
                held.add("gathered parameters", sum(whole.values()))
            elif launched:
                held.add("communication", -launched.pop(0))
            held.mark(label)
        elif event == "release":
            held.add("gathered parameters", -sum(gathered.pop(t.name, 0) for t in ins.tensors))
        series.append(held.total)
    parts_at = {k: v for k, v in held.at_parts.items() if v}
    return MemoryPeak(plan.rank, base, held.peak, held.at, parts_at, tuple(series))


# What each instruction kind does to a rank's memory, by its class exactly (no isinstance
# order: a unit gather gathers, a clip's all-reduce frees gradients as a sum's does); a kind
# not listed holds nothing beyond its compute (tests/tools check every key is an instruction).
MEMORY_EVENTS = {ReduceScatter: "scatter", AllReduce: "reduce", TieAllReduce: "reduce",
                 ClipGradNorm: "reduce", OptimizerStep: "step", AllGather: "gather",
                 UnitGather: "gather", ReleaseParams: "release", UnitRelease: "release"}
_BACKWARDS = frozenset(cls.runs for cls in (Backward, BackwardInput, BackwardWeight))


def _backward(held: _Held, part, label: str, saved, act, graded: Set[int], grads_of) -> None:
    key = (part.stage, part.microbatch)
    whole = act.get(part.stage, 0)
    if not isinstance(part, BackwardWeight):
        held.add("activations", whole - saved.get(key, 0))   # a checkpointed one recomputes
        saved[key] = whole
        held.mark(label)
    if part.stage not in graded and not isinstance(part, BackwardInput):
        graded.add(part.stage)
        held.add("gradients", grads_of.get(part.stage, 0))
    if not isinstance(part, BackwardInput):
        held.add("activations", -saved.pop(key, 0))
    held.mark(label)


def _kept_grad_bytes(plan: ExecutionPlan, stage: int) -> int:
    """The gradient buffers kept between steps: each ALL_REDUCE bucket (data parallel, ties)
    and, at ZeRO stage 1, each REDUCE_SCATTER's packed bucket."""
    out = 0
    for ins in plan.instructions:
        if isinstance(ins, ReduceScatter) and stage == 1:
            out += ins.padded_nbytes
        elif type(ins) in (AllReduce, TieAllReduce):
            out += sum(t.nbytes for t in ins.tensors)
    return out


def _stage_grad_bytes(plan: ExecutionPlan, params: Sequence[ParamSpec]) -> Dict[int, int]:
    """stage -> bytes of its trained parameters' whole gradients on this rank (a rank with
    several stages: its parameters split evenly by name prefix is not known, so all of them
    go to the first stage that runs a backward)."""
    total = sum(_grad_bytes(p) for p in {id(p): p for p in params}.values())
    stages = sorted(plan.local_stages)
    return {stages[0]: total} if stages else {}


def _grad_bytes(p: ParamSpec) -> int:
    return p.nbytes if p.trained else 0


def _gather_buffer(ins: AllGather, copies: int) -> int:
    """What a launched gather holds until it unpacks: the packed d parts, this rank's part,
    and the transport's own copies of the packed parts."""
    padded = ins.padded_nbytes
    return padded * (1 + copies) + padded // len(ins.ranks)


def _rows_bytes(p: ParamSpec, ins: AllGather, rank: int) -> int:
    """This rank's rows of `p` (torch.chunk's, as ZeRO shards them)."""
    rows = p.shape[0] if p.shape else 1
    return chunk_range(rows, len(ins.ranks), sorted(ins.ranks).index(rank))[1] * p.row_bytes


def fit_report(peaks: Dict[int, MemoryPeak], capacity: int, device: str, plan: ExecutionPlan) -> str:
    """Whether every rank's predicted peak fits `capacity` bytes: the highest rank, the
    instruction holding its peak, its parts, and what to change when it does not fit."""
    if not peaks:
        return ""
    worst = max(peaks.values(), key=lambda m: m.peak)
    parts = ", ".join(f"{k} {_size(v)}" for k, v in sorted(worst.parts.items(), key=lambda kv: -kv[1]))
    head = (f"memory on {device} ({_size(capacity)}): highest rank {worst.rank}, peak "
            f"{_size(worst.peak)} at {worst.at} ({parts})")
    if worst.fits(capacity):
        return f"{head}: fits, {_size(capacity - worst.peak)} free"
    over = [r for r, m in sorted(peaks.items()) if not m.fits(capacity)]
    return "\n".join([f"{head}: DOES NOT FIT on ranks {over[:8]}{' ...' if len(over) > 8 else ''}, "
                      f"{_size(worst.peak - capacity)} over"] + _advice(worst, plan))


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2 ** 30 else f"{nbytes / 2**20:.2f} MiB"


def _advice(worst: MemoryPeak, plan: ExecutionPlan) -> List[str]:
    """What to change, from the largest parts of the peak."""
    parts, stage = worst.parts, zero_stage(plan) if plan.training else 0
    out = []
    if parts.get("activations", 0) >= max(parts.values()) / 2:
        if plan.checkpointing != "always":
            out.append("  - activations dominate: module.config.set_activation_checkpointing(True) "
                       "or graph.config.set_activation_checkpointing(\"always\")")
        out.append("  - fewer rows per micro-batch: more gradient accumulation steps "
                   "(config.set_gradient_accumulation_steps), or more data-parallel ranks")
    if parts.get("optimizer", 0) + parts.get("gradients", 0) + parts.get("gradient buffers", 0) \
            >= max(parts.values()) / 2 and stage < 3:
        data_parallel = any(isinstance(i, (AllReduce, ReduceScatter)) for i in plan.instructions)
        out.append(f"  - model state dominates: config.enable_zero(True, stage={min(stage + 1, 3)}) "
                   "shards it over the data-parallel ranks"
                   + ("" if data_parallel else " (this stage has none: give it several ranks)"))
    out.append("  - more pipeline stages or tensor parallelism split the parameters and their state")
    return out
