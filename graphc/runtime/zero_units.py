"""ZeRO stage 3 gathered unit by unit inside a stage's forward and backward.

NOTE: ZeRO units
Gathering a rank's whole stage once per step (NOTE: ZeRO stage 3) holds it whole from the
first forward to the last backward: a rank's high-water is then ZeRO-2's. With
enable_zero(True, stage=3, unit_bytes=...) the compiler cuts the stage's sharded parameters
into units (a module, or consecutive modules up to unit_bytes, in order of first use:
insert_zero_units) and places them statically:
- in the stage program: zero_unit_begin(k) before unit k's first op and zero_unit_end(k) after
  its last (through views of its parameters), fx nodes (graphc/ops/zero_units.py);
- in the plan: after each Forward and Backward, the unit gathers and releases it runs (`0F1.GATHER u2`, `0B1.RELEASE u2`),
  in its order, from a walk over the rank's computes (insert_zero_units.unit_events): a
  forward gathers in unit order what is not whole and, with reshard-after-forward on (the
  default), frees each unit after its last use; a backward gathers in reverse order the
  units autograd keeps for it (not a unit whose readers are linear in it with inputs
  needing no gradient: the first layer on the batch) and frees each once done, or, gathered
  once per step, only in the step's last backward, which frees every unit (after the step a
  whole copy would be stale); a recomputed (checkpointed) micro-batch's backward first runs
  its forward again unit by unit, freeing each unit after its last use there but the last
  (the backward's first), then gathers again in reverse order those the backward reads
  (`0B0.GATHER u0`, `0B0.RELEASE u0`, ..., `0B0.GATHER u2`, `0B0.RELEASE u2`, `0B0.GATHER
  u1`): the whole stage is never whole at once (kept per step, it gathers every unit and
  keeps them). The stage's REDUCE_SCATTERs are one per unit in backward
  order, so GradSync launches each as soon as its unit's gradients are final.
At run time the stage's UnitGatherer does what the running compute lists:
- forward: begin(k) waits for unit k's gather (launched ahead) and launches the next listed
  one (prefetch: it runs while unit k computes); end(k) frees unit k if listed. Freeing is
  storage.resize_(0) (NOTE: ZeRO stage 3), so the tensors autograd saved stay valid;
- backward: what a unit's backward reads of its parameters are the tensors autograd saved,
  so the forward's saved-tensor hook marks those of unit k (by storage) and the unpack hook
  makes unit k whole before the backward kernel reads it. Reaching unit k frees the units
  after it that the backward has read (their kernels have run) and finishes the reduce-
  scatter in flight (at most one: its gradient and scratch are freed before unit k's
  gradient exists). When a unit's gradient is final (its reduce-scatter launched) the unit
  is freed at once, the step's last backward launches the gather of the unit before it then
  (not earlier, beside the unit's own gradient), and, with no clipping or loss scaling
  reading the whole step's gradients, its shards step at once on their reduced gradient,
  which is then dropped (each parameter steps once on its own gradient, as in NOTE: ZeRO
  step overlap). The saved tensors say when a unit is needed, so a unit read out of the
  plan's order is gathered then: correct, only later than planned;
- a checkpointed micro-batch's recompute, in its backward, makes each unit whole at
  begin(k) (prefetching the next listed) and frees at end(k) those the plan frees there
  (ComputeUnits: a release in a backward's listing followed by a gather of a later unit);
  the backward regathers them as any backward does. A unit listed twice in one compute is
  found from where the compute has got to (UnitGatherer.cursor);
- on gloo every unit is gathered into its parameters themselves (a broadcast per parameter
  and rank's rows) and reduced from its gradients themselves (a reduce per parameter and
  rank's rows): gloo's all-gather and reduce-scatter hold a scratch copy of the whole bucket
  (See NOTE: ZeRO rows in place, zero_rows.py).
A rank holding several chunks (interleaved) has a UnitGatherer per chunk, each driving its
own stage's computes; the group's reduce-scatters are one per unit, in the order the units'
gradients become final over the chunks. A split backward (zero_bubble, ZB-V) is two computes
that both read the units: the input half I and the weight half W (which runs the nodes leading
to the parameters again, and they unpack them: NOTE: Weight gradients) each gather, in reverse
order, the units they read and free each once done (`0I1.GATHER u2`, `0W1.GATHER u2`); a
recomputed micro-batch runs its forward again in I; the step's last W frees what is left.
DualPipeV's overlapped pair runs its forward, then its backward (two computes of two chunks,
each driving its own chunk's UnitGatherer): the plan lists the forward's unit events, then the
backward's, after the pair (`(2F3;1B1)OVERLAP_F_B`, `2F3.GATHER u0`, ..., `1B1.GATHER u1`),
and each event names its compute. Several data-parallel groups in one stage keep the
whole-stage gathers (the plan's zero note says so).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

import torch

from ..ops.zero_units import gathering_units
from ..plan.instructions import ACT, COMPUTE_RUNS, GRAD, UNIT_EVENTS, AllGather, UnitGather, UnitRelease
from .zero import Shard, ZeroShards


class _UnitSaved:
    """A tensor autograd saved that is (a view of) unit `unit`'s parameter."""

    __slots__ = ("tensor", "unit")

    def __init__(self, tensor: torch.Tensor, unit: int):
        self.tensor, self.unit = tensor, unit


class UnitGatherer:
    """One stage's units on this rank and what each of its computes gathers and frees."""

    def __init__(self, zero: ZeroShards, units: Dict[int, AllGather],
                 events: Dict[Tuple[str, int], "ComputeUnits"]):
        self.zero, self.units, self.events = zero, units, events
        self.shards: Dict[int, List[Shard]] = {k: [zero.by_name[t.name] for t in g.tensors]
                                               for k, g in units.items()}
        self.by_storage: Dict[int, int] = {}    # data_ptr of a whole unit parameter -> its unit
        self.direction, self.listed, self.releases = ACT, [], set()
        self.recompute_releases: Set[int] = set()
        self.cursor = 0                         # listed[:cursor] reached by the running compute
        self.position: Dict[int, int] = {}      # unit -> where in listed it was last reached
        self.touched: List[int] = []            # units the running backward has read
        self.recomputing = False
        self.unit_of = {t.name: k for k, g in units.items() for t in g.tensors}
        # the step's last compute that reads units in a backward (a whole one, or a split one's
        # weight half): a whole copy left after it would be stale after the step
        self.last_backward = next((key for key in reversed(events) if key[0] != ACT), None)
        self.prefetch_late = False
        self.reached = None   # called when the backward reaches a unit (finishes the reduce-scatters)

    @staticmethod
    def from_plan(plan, zero: Optional[ZeroShards]) -> Dict[int, "UnitGatherer"]:
        """Each local stage's units and per-compute events, by stage (a rank holding several
        chunks has one for each chunk with units; empty: no unit events in the plan)."""
        if zero is None or not any(isinstance(ins, UNIT_EVENTS) for ins in plan.instructions):
            return {}
        found: Dict[int, tuple] = {}   # stage -> (units, events by compute, in plan order)
        for ins in plan.instructions:   # by kind exactly: a UnitGather is an AllGather too
            if ins.runs in COMPUTE_RUNS:
                for part in ins.parts:  # an overlapped pair: its forward, then its backward
                    _, events = found.setdefault(part.stage, ({}, {}))
                    events.setdefault((_direction(part), part.microbatch), [])
            elif type(ins) in (UnitGather, UnitRelease):   # each names its compute
                units, events = found[ins.stage]
                if type(ins) is UnitGather:
                    units.setdefault(ins.unit, AllGather(ins.ranks, ins.tensors))
                events[(ins.direction, ins.microbatch)].append(("G" if type(ins) is UnitGather else "R",
                                                                ins.unit))
        return {s: UnitGatherer(zero, units, {key: ComputeUnits.of(e, key[0] != ACT)
                                              for key, e in events.items()})
                for s, (units, events) in found.items() if units}

    # -- a compute ---------------------------------------------------------------------
    @contextmanager
    def computing(self, direction: str, microbatch: int):
        """Within the block the stage program's unit boundaries and saved tensors follow what
        the plan lists for this compute."""
        self.direction = direction
        listed = self.events.get((direction, microbatch), ComputeUnits.of([]))
        self.listed, self.releases = listed.gathers, listed.releases
        self.recompute_releases = listed.recompute_releases
        self.cursor, self.position = 0, {}
        # the step's last backward launches each unit's reduce-scatter as its gradient is final:
        # the unit before is prefetched then, not while the unit's kernels run (their gradient
        # and the gathered copy would be in memory at once)
        last = (direction, microbatch) == self.last_backward
        self.prefetch_late = last and direction == GRAD
        self.touched = []
        if self.listed:
            self._launch(self.listed[0])
        with gathering_units(self):
            yield
        for k in self.listed:        # a gather nothing waited for (a unit the compute skipped)
            if self._in_flight(k):
                self._make_whole(k)
        for k in sorted(self.releases):
            if self._whole(k):
                self._release(k)
        if last:                     # the step's last backward: a whole copy would be stale after
            for k in self.units:     # the step (one the backward gathered beyond the plan)
                if not self.shards[k][0].released:
                    self._release(k)

    @contextmanager
    def recomputing_forward(self):
        self.recomputing = True
        try:
            yield
        finally:
            self.recomputing = False

    def begin(self, k: int) -> None:
        """Before unit k's first op in the forward (fx node zero_unit_begin), or in a
        checkpointed micro-batch's forward run again inside its backward."""
        self._reach(k)
        self._make_whole(k)
        self._prefetch_after(k)

    def end(self, k: int) -> None:
        """After unit k's last op in the forward (fx node zero_unit_end)."""
        if self.recomputing:
            if k in self.recompute_releases:   # gathered again when the backward reads it
                self._release(k)
        elif self.direction == ACT and k in self.releases:
            self._release(k)

    # -- saved tensors -----------------------------------------------------------------
    def pack(self, t: torch.Tensor):
        """A saved tensor of a unit's parameter marked with its unit, others as they are."""
        k = self.by_storage.get(t.untyped_storage().data_ptr())
        return t if k is None else _UnitSaved(t, k)

    def unpack(self, saved):
        if not isinstance(saved, _UnitSaved):
            return saved
        k = saved.unit
        if k not in self.touched:
            for j in self.touched:     # read before k in this backward: their kernels have run
                if j > k and j in self.releases and not self.shards[j][0].released:
                    self._release(j)
            self.touched.append(k)
            if self.reached is not None:
                self.reached()
            self._reach(k)
            self._make_whole(k)
            if not self.prefetch_late:
                self._prefetch_after(k)
        elif not self._whole(k):
            self._make_whole(k)
        return saved.tensor

    def scattered(self, ins) -> None:
        """A bucket's gradients are final (the step's last backward ran its kernels): the unit
        they are is freed now if this backward lists it, rather than when the backward reaches
        the unit before (a unit whose parameters no backward kernel reads is not reached)."""
        k = self.unit_of.get(ins.tensors[0].name)
        if k is None or self.direction == ACT:
            return
        if k in self.releases and not self.shards[k][0].released:
            self._release(k)
        if self.prefetch_late:
            self._prefetch_after(k)
            if self.reached is not None and not any(j < k for j in self.listed):
                # no unit before this one is read by the backward, so none will say the backward
                # reached it: the reduce-scatter finishes now, not beside the rest's gradients
                self.reached()

    # -- gathers and releases ----------------------------------------------------------
    def _in_flight(self, k: int) -> bool:
        return self.units[k] in self.zero.gathering

    def _whole(self, k: int) -> bool:
        """Unit k's parameters hold their values (storage given back and no gather writing it)."""
        return not self.shards[k][0].released and not self._in_flight(k)

    def _launch(self, k: int) -> None:
        if self.shards[k][0].released and not self._in_flight(k):
            self.zero.launch_gather(self.units[k])

    def _make_whole(self, k: int) -> None:
        if not self._whole(k):
            self.zero.gather(self.units[k])
        for s in self.shards[k]:   # (whole before any release too: the first step's first use)
            self.by_storage[s.param.untyped_storage().data_ptr()] = k

    def _reach(self, k: int) -> None:
        """The running compute reached unit k: its next place in the listed gathers (a unit
        may be listed twice: a recomputed forward's gather, then the backward's)."""
        if k in self.listed[self.cursor:]:
            at = self.listed.index(k, self.cursor)
            self.position[k], self.cursor = at, at + 1

    def _prefetch_after(self, k: int) -> None:
        """The gather listed after the place where unit k was reached, launched."""
        at = self.position.get(k)
        if at is not None and at + 1 < len(self.listed):
            self._launch(self.listed[at + 1])

    def _release(self, k: int) -> None:
        if self._in_flight(k):       # a gather writes into the storage: never freed under it
            self.zero.gather(self.units[k])
        for s in self.shards[k]:
            self.by_storage.pop(s.param.untyped_storage().data_ptr(), None)
            s.release()


@dataclass(frozen=True)
class ComputeUnits:
    """What one compute does with the units, from the plan's listing after it: the units it
    gathers in order (a recomputed forward's, then the backward's), those it releases after a
    use in the forward or once the backward is done with them, and those a recomputed forward
    releases after their last use there (gathered again by the backward if it reads them)."""

    gathers: List[int]
    releases: Set[int]
    recompute_releases: Set[int]

    @staticmethod
    def of(events: List[Tuple[str, int]], backward: bool = False) -> "ComputeUnits":
        """From ("G" | "R", unit) in plan order: in a backward a release followed by a gather of
        a later unit is the recomputed forward's (the backward gathers in reverse order)."""
        again = {i for i, (kind, k) in enumerate(events) if backward and kind == "R"
                 and any(g == "G" and j > k for g, j in events[i + 1:])}
        return ComputeUnits([k for kind, k in events if kind == "G"],
                            {k for i, (kind, k) in enumerate(events) if kind == "R" and i not in again},
                            {events[i][1] for i in again})


def _direction(ins) -> str:
    """F, B, or a split backward's I or W (ACT and GRAD are F and B)."""
    return ins.letter
