"""The walk of NOTE: Peak memory model (peak.py): what one rank holds, instruction by instruction.

Each instruction kind names its effect, the Walk method `holds` (plan/instruction_base.py: a
unit gather gathers as AllGather does, a clip's all-reduce frees gradients as a sum's does, by
inheritance) and each compute part's is one entry of `COMPUTES` (by its run entry, `part.runs`,
as the runtime dispatches); a kind with neither holds nothing beyond its compute. tests/tools/test_memory_model.py checks every key.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ...plan.instructions import (INSIDE_COMPUTE, AllGather, AllReduce, Backward, BackwardInput,
                                  BackwardWeight, ClipGradNorm, Forward, Instruction,
                                  OptimizerStep, Recv, ReduceScatter, ReleaseParams, Send,
                                  TieAllReduce, UnitGather)
from ...plan.plan import ExecutionPlan, checkpointed_microbatches
from ..cost_model import CostModel
from .memory import stage_input_bytes
from .model_state import ParamSpec, model_state, zero_stage


@dataclass(frozen=True)
class Transport:
    """What a transport's ZeRO collectives hold (graphc/runtime/zero.py, zero_rows.py)."""

    gather_copies: int      # its own copies of a gathered bucket (gloo's all-gather into one tensor: 1)
    rows_in_place: bool     # stages 2 and 3 rank by rank on views (NOTE: ZeRO rows in place)


TRANSPORTS = {"gloo": Transport(1, True), "nccl": Transport(0, False), "local": Transport(0, False)}


STEP_START = "step start"
Where = Union[int, str]     # an instruction's index, or STEP_START


class Held:
    """Bytes held by kind while the walk goes. Two highs: `between`, over the points a
    running rank's probe also measures (each instruction's end, a recomputed micro-batch),
    and `peak`, which adds what an instruction holds only inside itself. Where each high
    happens (`at`, `between_at`) is an instruction's index, or STEP_START: only the two
    highs are labelled (Walk.label), not every instruction walked."""

    def __init__(self, base: Dict[str, int]):
        self.parts = dict(base)
        self.total = sum(self.parts.values())   # the parts' sum, kept as they change (add)
        self.peak = self.between = self.total
        self.at = self.between_at = STEP_START
        self.at_parts = dict(self.parts)
        self.series: List[int] = []

    def add(self, kind: str, nbytes: int) -> None:
        self.parts[kind] = self.parts.get(kind, 0) + nbytes
        self.total += nbytes

    def point(self, where: Where) -> None:
        """A point the probe measures too."""
        if self.total > self.between:
            self.between, self.between_at = self.total, where
        self.inside(where)

    def inside(self, where: Where, extra: Optional[Dict[str, int]] = None) -> None:
        """A moment inside an instruction, holding `extra` beside the parts."""
        total = self.total + sum(extra.values()) if extra else self.total
        if total > self.peak:
            extra = extra or {}
            self.peak, self.at = total, where
            self.at_parts = {k: self.parts.get(k, 0) + extra.get(k, 0)
                             for k in [*self.parts, *(k for k in extra if k not in self.parts)]}


class Walk:
    """One rank's plan walked once (See NOTE: Peak memory model)."""

    def __init__(self, plan: ExecutionPlan, params: Sequence[ParamSpec], costs: CostModel,
                 transport: Transport, recv_window: int, batch: int):
        self.plan, self.copies = plan, transport.gather_copies
        self.stage = zero_stage(plan) if plan.training else 0
        self.in_place = transport.rows_in_place and self.stage in (2, 3)
        self.by_name = {n: p for p in params for n in p.names}
        state = model_state(plan, params)
        self.held = Held({"parameters": state.params, "optimizer": state.optimizer,
                          "gradient buffers": _kept_grad_bytes(plan, self.stage), "batch": batch})
        self.base = self.held.total - batch      # between steps
        self.act, self.inputs = costs.activation_bytes, stage_input_bytes(plan, costs)
        self.recomputed = checkpointed_microbatches(plan.checkpointing, plan.num_microbatches)
        self.grads_of = _stage_grad_bytes(plan, params)
        self.saved: Dict[Tuple[int, int], int] = {}
        self.graded: set = set()
        self.gathered: Dict[str, int] = {}       # stage 3: whole parameters, until released
        self.gathering: Dict[AllGather, int] = {}   # gathers launched by the optimizer step
        self.scattering: Dict[ReduceScatter, int] = {}   # reduce-scatters in flight: their buffers
        self.launches = _scatter_launches(plan)     # backward index -> the scatters it launches
        self.launched = {s for group in self.launches.values() for s in group}
        self.units = any(type(i) is UnitGather for i in plan.instructions)
        # gathered per unit without clipping: each unit's shards step once reduced (NOTE: ZeRO units)
        self.steps_per_unit = self.units and not any(type(i) is ClipGradNorm for i in plan.instructions)
        self.recvs = _Receives(plan, recv_window, self.held)
        self.sent: set = set()
        self.index = 0       # the instruction being walked

    def label(self, where: "Where") -> str:
        """How a peak names where it happens (MemoryPeak.at)."""
        return where if where == STEP_START else instruction_label(where, self.plan.instructions[where])

    def run(self) -> None:
        for i, ins in enumerate(self.plan.instructions):
            self.index = i
            for part in ins.parts:
                effect = COMPUTES.get(part.runs)
                if effect is not None:
                    effect(self, part)
                    self.recvs.consumed(part)
            if ins.holds:
                getattr(self, ins.holds)(ins)
            for scatter in self.launches.get(i, ()):
                self._launch_scatter(scatter)
            if ins.runs == INSIDE_COMPUTE:   # a unit's gather or release, inside its compute
                self.held.inside(self.index)
            else:
                self.held.point(self.index)
            self.held.series.append(self.held.total)

    # -- compute ------------------------------------------------------------------------
    def forward(self, part: Forward) -> None:
        key = (part.stage, part.microbatch)
        self.saved[key] = self.inputs.get(part.stage, 0) if part.microbatch in self.recomputed \
            else self.act.get(part.stage, 0)
        self.held.add("activations", self.saved[key])

    def backward(self, part) -> None:
        key, whole = (part.stage, part.microbatch), self.act.get(part.stage, 0)
        if part.runs != BackwardWeight.runs:
            recompute = whole - self.saved.get(key, 0)
            self.held.add("activations", recompute)   # a checkpointed one recomputes first
            self.saved[key] = whole
            if recompute:
                self.held.point(self.index)
        if part.stage not in self.graded and part.runs != BackwardInput.runs:
            self.graded.add(part.stage)
            self.held.add("gradients", self.grads_of.get(part.stage, 0))
        if part.runs != BackwardInput.runs:
            self.held.add("activations", -self.saved.pop(key, 0))

    # -- gradient collectives -----------------------------------------------------------
    def _launch_scatter(self, ins: ReduceScatter) -> None:
        """Launched by the backward that makes its bucket final: the gradients packed (d parts,
        padded; stage 1 packs into its kept bucket) and dropped, or (rows in place) reduced
        where they are, and this rank's part received into a buffer of its own."""
        packed, part = ins.padded_nbytes, ins.padded_nbytes // len(ins.ranks)
        if not self.in_place:
            self.held.add("gradients", -self._grad_bytes(ins))
        if self.units:          # one in flight: the one before finishes (NOTE: ZeRO units)
            for flying in list(self.scattering):
                self._finish_scatter(flying)
        self.scattering[ins] = part + (packed if self.stage != 1 and not self.in_place else 0)
        self.held.add("communication", self.scattering[ins])

    def _finish_scatter(self, ins: ReduceScatter) -> None:
        """This rank's summed part becomes its shards' gradients (stages 2 and 3; stage 1 copies
        it into its row of the kept bucket); per unit, they step and drop it at once. Rows in
        place, the whole gradients are dropped here."""
        self.held.add("communication", -self.scattering.pop(ins))
        if self.in_place:
            self.held.add("gradients", -self._grad_bytes(ins))
        if self.stage != 1 and not self.steps_per_unit:
            self.held.add("gradients", ins.padded_nbytes // len(ins.ranks))

    def recv(self, ins: Recv) -> None:
        self.recvs.take(ins)

    def scatter(self, ins: ReduceScatter) -> None:
        if ins not in self.scattering and ins not in self.launched:
            self._launch_scatter(ins)       # no backward launched it (an unused bucket)
        if ins in self.scattering:
            self._finish_scatter(ins)

    def reduce(self, ins: AllReduce) -> None:
        """The bucket's gradients are summed in the bucket kept between steps and the
        parameters' own dropped."""
        self.held.add("gradients", -sum(self._grad_bytes_of(t.name) for t in ins.tensors))

    def optimizer_step(self, ins: OptimizerStep) -> None:
        """Steps with the gradients (stages 1, 2: bucket by bucket, each bucket's gather
        launched as it steps), then zero_grad(set_to_none) drops them."""
        if self.stage in (1, 2):
            for g in (x for x in self.plan.instructions if type(x) is AllGather):
                self.gathering[g] = self._gather_buffer(g)
                self.held.add("communication", self.gathering[g])
                self.held.inside(self.index)
        self.held.inside(self.index)
        self.held.add("gradients", -self.held.parts.get("gradients", 0))

    def gather(self, ins: AllGather) -> None:
        if self.stage == 3:       # the shards own their rows: the whole parameters are new
            whole = {t.name: self.by_name[t.name].nbytes for t in ins.tensors}
            self.held.inside(self.index, {"communication": self._gather_buffer(ins)})
            self.gathered.update(whole)
            self.held.add("gathered parameters", sum(whole.values()))
        elif ins in self.gathering:
            self.held.add("communication", -self.gathering.pop(ins))

    def send(self, ins: Send) -> None:
        """A backward's input gradients stay among the step's values until its end (the
        runtime's `produced`), whichever peers they go to; a forward's outputs are its
        activations."""
        if ins.direction == "F":
            return
        for t in ins.tensors:
            key = (ins.stage, ins.microbatch, t.name)
            if key not in self.sent:
                self.sent.add(key)
                self.held.add("sent gradients", t.nbytes)

    def release(self, ins: ReleaseParams) -> None:
        self.held.add("gathered parameters", -sum(self.gathered.pop(t.name, 0) for t in ins.tensors))

    # -- sizes --------------------------------------------------------------------------
    def _gather_buffer(self, ins: AllGather) -> int:
        """What a launched gather holds until it unpacks: the packed d parts and this rank's
        part, and the transport's own copies of the packed parts; none rows in place, or at
        stage 3 when every tensor's rows split evenly (gathered straight into the parameter)."""
        d = len(ins.ranks)
        if self.in_place or self.stage == 3 and all(t.shape and t.shape[0] % d == 0 for t in ins.tensors):
            return 0
        padded = ins.padded_nbytes
        return padded * (1 + self.copies) + padded // d

    def _grad_bytes(self, ins) -> int:
        return sum(self._grad_bytes_of(t.name) for t in ins.tensors)

    def _grad_bytes_of(self, name: str) -> int:
        p = self.by_name.get(name)
        return p.nbytes if p is not None and p.trained else 0


class _Receives:
    """The receive buffers a rank holds: each peer's next `window` receives posted ahead
    (RecvActor), and a received value until the compute that reads it."""

    def __init__(self, plan: ExecutionPlan, window: int, held: Held):
        self.held, self.window = held, window
        self.queues: Dict[int, List[Recv]] = defaultdict(list)
        for ins in plan.instructions:
            if type(ins) is Recv:
                self.queues[ins.peer].append(ins)
        self.taken: Dict[int, int] = {p: 0 for p in self.queues}
        self.waiting: Dict[Tuple[int, int, str], int] = defaultdict(int)   # taken, not yet read
        held.add("communication", sum(_nbytes(q[:window]) for q in self.queues.values()))

    def take(self, ins: Recv) -> None:
        q, k = self.queues[ins.peer], self.taken[ins.peer]
        self.taken[ins.peer] = k + 1
        self.held.add("communication", -_nbytes([ins]) + _nbytes(q[k + self.window:k + self.window + 1]))
        self.waiting[(ins.stage, ins.microbatch, ins.direction)] += _nbytes([ins])
        self.held.add("received", _nbytes([ins]))

    def consumed(self, part: Instruction) -> None:
        """A forward reads its received inputs (kept as its activations from here); a backward
        its received gradients (freed)."""
        direction = "F" if part.runs == Forward.runs else "B"
        self.held.add("received", -self.waiting.pop((part.stage, part.microbatch, direction), 0))


def _nbytes(recvs: Sequence[Recv]) -> int:
    return sum(t.nbytes for r in recvs for t in r.tensors)


def _scatter_launches(plan: ExecutionPlan) -> Dict[int, List[ReduceScatter]]:
    """instruction index -> the REDUCE_SCATTERs its backward launches: each bucket's gradients
    are final after the last backward before it in the plan (GradSync's hooks)."""
    out: Dict[int, List[ReduceScatter]] = defaultdict(list)
    last = None
    for i, ins in enumerate(plan.instructions):
        if any(p.runs in (Backward.runs, BackwardWeight.runs) for p in ins.parts):
            last = i
        elif type(ins) is ReduceScatter and last is not None:
            out[last].append(ins)
    return out


def _kept_grad_bytes(plan: ExecutionPlan, stage: int) -> int:
    """The gradient buffers kept between steps: each ALL_REDUCE bucket (data parallel, ties)
    and, at ZeRO stage 1, each REDUCE_SCATTER's packed bucket."""
    out = 0
    for ins in plan.instructions:
        if type(ins) is ReduceScatter and stage == 1:
            out += ins.padded_nbytes
        elif type(ins) in (AllReduce, TieAllReduce):
            out += sum(t.nbytes for t in ins.tensors)
    return out


def _stage_grad_bytes(plan: ExecutionPlan, params: Sequence[ParamSpec]) -> Dict[int, int]:
    """stage -> bytes of its trained parameters' whole gradients on this rank (a rank with
    several stages: which parameters are whose is not known here, so all of them go to the
    first stage that runs a backward)."""
    total = sum(p.nbytes for p in {id(p): p for p in params}.values() if p.trained)
    stages = sorted(plan.local_stages)
    return {stages[0]: total} if stages else {}


# What each compute part does, by its run entry; each other kind names its own: Walk.<holds>
COMPUTES = {Forward.runs: Walk.forward, Backward.runs: Walk.backward,
            BackwardInput.runs: Walk.backward, BackwardWeight.runs: Walk.backward}


def instruction_label(index: int, ins) -> str:
    """How a peak names the instruction it happens at (MemoryPeak.at): `12: 0F3`."""
    return f"{index}: {ins}"[:80]
