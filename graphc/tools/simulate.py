"""simulate(): predicts a step's timeline from every rank's plan and per-instruction costs.

Each rank issues its instructions in plan order, one at a time, as the runtime does:
  * compute (forward, backward, its split halves backward_input / backward_weight, and
    DualPipeV's overlapped pair) takes its cost (CostModel.compute);
  * a send occupies the SENDER for send_overhead + bytes * send_per_byte (the CPU the
    transport spends in isend: a memcpy into the shared-memory ring, or gloo's hand-off),
    then its data arrives at the peer after the link's latency plus bytes / bandwidth
    (transfers on one directed link queue behind each other; CostModel.link picks NVLink
    or the network between nodes);
  * a recv ends recv_overhead + bytes * recv_per_byte after its data has arrived or it
    was issued, whichever is later (the runtime posts receives ahead, so only the wait and
    the copy out are charged); a receiver that had to wait notices the data
    `costs.noticed(wait)` late (a polling receiver backs off while it waits);
  * a collective (gradient bucket, tie or clip all-reduce, or a boxing conversion listed
    after its compute) starts when its last member issues it and takes
    CostModel.collective (a ring or tree over the group's slowest link);
  * with `sends_complete_on_delivery` (gloo), the optimizer step and the end of a step
    wait until every send of the rank has been delivered (the runtime drains its sends).
With `steps` > 1 the plans run that many times back to back, as a training loop calls
the graph: a rank starts step k+1 as soon as it finished its own step k, while others
may still be in step k, bounded only by the data dependencies (messages on a link are
matched in order across steps). `step_time` is then the steady-state period: the mean
time between the ends of consecutive steps after the first.
If the ranks that compute outnumber `cores`, every compute span is stretched by
ranks / cores: processor sharing with all ranks busy (an upper bound; see docs/inspect.md).
Link contention between different rank pairs is not modelled.

NOTE: Activation bytes
A rank's peak activation bytes (`RankSummary.peak_activation_bytes`) walk its compute in
plan order: a forward keeps its stage's activation bytes for that micro-batch (only the
stage's input bytes when the plan's checkpoint mode recomputes that micro-batch); a
backward of a checkpointed one first recomputes them (its peak counts them back), and the
backward, or the W half of a split one, frees them; an I half recomputes and keeps them for
its W. Inference holds one micro-batch at a time.

The ranks run from a worklist: a rank moves on until it must wait for a message or a
collective, and the rank that satisfies the wait puts it back on the list, so the work is
linear in the number of instructions times steps (a thousand ranks, four steps: two
million instructions). The times land in one array per rank; `SimResult.timeline` builds
a rank's Spans when asked, and `signature(rank)` compares ranks without building them.

NOTE: Symmetric ranks
Ranks of one stage usually run the same instructions at the same times (data-parallel
replicas, tensor-parallel shards), so a thousand-rank plan has a few dozen distinct
timelines. Before running, the simulator partitions the ranks into classes that provably
share one timeline, and runs one representative per class (`_Symmetry`):
  * start: ranks are alike when their instructions have the same labels and costs (every
    op's seconds, bytes on the wire, latency, group size) and their sends (and receives)
    are split among peers in the same pattern (the k-th send goes to the same peer as the
    j-th on one rank exactly when it does on the other);
  * refine until stable: ranks stay alike when, at every index, a send's receiver (a
    recv's sender) is alike and matches it at the same index of its own plan, and a
    collective's members, with the index at which each issues it, are alike as a multiset.
Every equation the simulation solves for a rank at an index (an end from its start and
cost; an arrival from the sender's link history; a collective's end from its members'
issue times) then reads the same (class, index) pairs for all ranks of a class, so
copying each representative's times to its class solves them all: the result is exact,
not an approximation. The representatives run as above, except that a representative's
send also feeds the links from the other ranks of its class to representatives (they
would send at the same time), and a collective waits for the representative of each
member's class to reach that member's index. Where the classes are as many as the ranks,
or the folded run cannot finish, every rank runs (and a plan that cannot finish is
reported as before).

Example:
    from graphc.tools.costs import CostModel
    result = simulate(compiled.plans, CostModel.uniform(num_stages=4))
    print(result.table())
"""
from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from ..errors import PlanError
from ..plan.instructions import (AllReduce, Backward, BackwardInput, BackwardWeight, Collective,
                                 Forward, Instruction, OverlapFB, Recv, Send)
from ..plan.plan import ExecutionPlan, checkpointed_microbatches
# the timeline vocabulary, shared with the measured traces the runtime writes
from ..runtime.trace import COMPUTE_KINDS, Span, Timeline
from .cost_model import CostModel

# activations a kind adds to the micro-batches a rank holds: a forward keeps its micro-batch
# until the backward (whole, or its weight half) frees it
_LIVE = {"forward": 1, "backward": -1, "backward_weight": -1}


def activation_peak(plan: ExecutionPlan, costs: CostModel) -> int:
    """Peak bytes of saved activations on one rank over its step (NOTE: Activation bytes)."""
    act, inputs = costs.activation_bytes, stage_input_bytes(plan, costs)
    if not plan.training:       # inference frees each micro-batch's activations at once
        return max((act.get(s, 0) for s in plan.local_stages), default=0)
    recomputed = checkpointed_microbatches(plan.checkpointing, plan.num_microbatches)
    held: Dict[Tuple[int, int], int] = {}
    live = peak = 0
    for ins in plan.instructions:
        for part in (ins.forward, ins.backward) if isinstance(ins, OverlapFB) else (ins,):
            if not isinstance(part, (Forward, Backward, BackwardInput, BackwardWeight)):
                continue
            key, whole = (part.stage, part.microbatch), act.get(part.stage, 0)
            if isinstance(part, Forward):
                held[key] = inputs.get(part.stage, 0) if part.microbatch in recomputed else whole
                live += held[key]
            elif isinstance(part, BackwardInput):   # recomputes; W still reads what I saved
                live += whole - held.get(key, 0)
                held[key] = whole
            else:
                if isinstance(part, Backward):      # a checkpointed one recomputes first
                    peak = max(peak, live + whole - held.get(key, 0))
                live -= held.pop(key, 0)
            peak = max(peak, live)
    return peak


def stage_input_bytes(plan: ExecutionPlan, costs: CostModel) -> Dict[int, int]:
    """Bytes a checkpointed micro-batch keeps per stage: the measured inputs where known,
    else what the stage receives per micro-batch (its activations from the stage before)."""
    out = dict(costs.input_bytes)
    for ins in plan.instructions:
        if isinstance(ins, Recv) and ins.direction == "F" and ins.microbatch == 0 \
                and ins.stage not in costs.input_bytes:
            out[ins.stage] = out.get(ins.stage, 0) + sum(t.nbytes for t in ins.tensors)
    return out


@dataclass
class RankSummary:
    rank: int
    stages: List[int]
    busy: float                # time spent in compute
    finish: float              # when the rank's last instruction ends
    bubble: float              # 1 - busy / step_time (ranks that compute)
    peak_live_microbatches: int
    peak_activation_bytes: int


@dataclass
class SimResult:
    timeline: Timeline
    step_time: float           # one step's makespan, or the steady-state period (steps > 1)
    ranks: List[RankSummary] = field(default_factory=list)
    step_ends: List[float] = field(default_factory=list)   # when the last rank ended each step
    steps: int = 1

    @property
    def first_step_time(self) -> float:
        return self.step_ends[0] if self.step_ends else self.step_time

    @property
    def bubble_fraction(self) -> float:
        """The mean bubble over the ranks that run a stage."""
        working = [r.bubble for r in self.ranks if r.stages]
        return sum(working) / len(working) if working else 0.0

    def table(self, unit: str = "ms", scale: float = 1e3) -> str:
        """A per-rank table: compute, finish, bubble, peak live micro-batches and memory."""
        head = (f"{'rank':>4}  {'stages':>6}  {'compute ' + unit:>12}  {'finish ' + unit:>12}  "
                f"{'bubble':>7}  {'live mb':>7}  {'peak act MiB':>12}")
        rows = [head]
        for r in self.ranks:
            rows.append(f"{r.rank:>4}  {','.join(map(str, r.stages)) or '-':>6}  "
                        f"{r.busy * scale:>12.3f}  {r.finish * scale:>12.3f}  {r.bubble:>7.1%}  "
                        f"{r.peak_live_microbatches:>7}  {r.peak_activation_bytes / 2**20:>12.3f}")
        what = (f"steady-state step time (period over {self.steps} steps; first step "
                f"{self.first_step_time * scale:.3f} {unit})" if self.steps > 1 else "step time")
        rows.append(f"{what} {self.step_time * scale:.3f} {unit}, mean bubble "
                    f"{self.bubble_fraction:.1%}")
        return "\n".join(rows)


def simulate(plans: Sequence[ExecutionPlan], costs: CostModel, steps: int = 1,
             cores: Optional[int] = None) -> SimResult:
    """Runs every rank's plan against `costs`; returns the timeline and per-rank summary.

    Args:
        plans: one ExecutionPlan per rank (CompiledGraph.plans), verified or not.
        costs: per-stage compute costs, transport and link costs, activation sizes.
        steps: consecutive steps to run; > 1 reports the steady-state period as step_time.
        cores: CPU cores the ranks share (None: each rank has its own device or core).
    Returns:
        SimResult with `step_time`, `bubble_fraction`, `ranks` and `timeline`.
    Raises:
        PlanError if the plans cannot finish (a recv or collective that nothing satisfies).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, found {steps}")
    sim = _Simulation(plans, costs, steps, cores)
    sim.run()
    return sim.result()


class SimTimeline(Mapping):
    """rank -> its Spans in issue order, built on demand from the simulated times."""

    def __init__(self, plans: Dict[int, ExecutionPlan], shown: Dict[int, tuple],
                 starts: Dict[int, array], ends: Dict[int, array]):
        self._plans, self._shown, self._starts, self._ends = plans, shown, starts, ends

    def __getitem__(self, rank: int) -> List[Span]:
        labels, kinds, mbs = self._shown[rank]
        n = len(labels)
        return [Span(rank, k % n, labels[k % n], kinds[k % n], mbs[k % n], t0, t1, k // n)
                for k, (t0, t1) in enumerate(zip(self._starts[rank], self._ends[rank]))]

    def __iter__(self) -> Iterator[int]:
        return iter(self._plans)

    def __len__(self) -> int:
        return len(self._plans)

    def signature(self, rank: int) -> tuple:
        """Equal for two ranks exactly when their timelines show the same boxes at the same
        times (ranks of one stage usually do): charts fold them into one row."""
        return self._shown[rank][0], self._starts[rank].tobytes(), self._ends[rank].tobytes()


# what the simulator does per instruction (the first item of each op)
_COMPUTE, _SEND, _RECV, _COLLECTIVE, _OPTIMIZER = range(5)
# with symmetric ranks folded (NOTE: Symmetric ranks): a send that also feeds the links of
# the other ranks of its class, and a collective waiting on the members' representatives
_FANOUT, _QCOLLECTIVE = 5, 6


class _Link:
    """One directed link: its messages' arrival times, how many were received, when it is
    free for the next message, and the receiver waiting on it."""

    __slots__ = ("src", "dst", "arrivals", "taken", "free", "waiter")

    def __init__(self, src: int = -1, dst: int = -1):
        self.src, self.dst = src, dst
        self.arrivals: List[float] = []
        self.taken, self.free, self.waiter = 0, 0.0, None


class _Issue:
    """The k-th collective over one group: members arrived, the latest arrival, members done,
    and those waiting for the rest."""

    __slots__ = ("issued", "latest", "done", "waiters")

    def __init__(self):
        self.issued, self.latest, self.done, self.waiters = 0, 0.0, 0, []


class _Group:
    """The collectives over one group of ranks, matched in issue order."""

    __slots__ = ("ranks", "size", "next_k", "open")

    def __init__(self, ranks: Tuple[int, ...]):
        self.ranks, self.size = ranks, len(ranks)
        self.next_k: Dict[int, int] = {}    # rank -> the number of its next collective here
        self.open: Dict[int, _Issue] = {}


class _Simulation:
    def __init__(self, plans: Sequence[ExecutionPlan], costs: CostModel, steps: int = 1,
                 cores: Optional[int] = None, fold: bool = True):
        self.plans = {p.rank: p for p in plans}
        self.costs, self.steps = costs, steps
        computing = sum(1 for p in plans if p.local_stages)
        self.stretch = max(1.0, computing / cores) if cores else 1.0
        self._cache: Dict[int, tuple] = {}      # id(instruction) -> (label, kind, mb, op)
        self._shown_p2p: Dict[tuple, tuple] = {}   # (type, stage, direction, mb) -> shown
        self._wires: Dict[Tuple[int, int], Tuple[float, float]] = {}   # (src, dst) -> link
        self._bytes: Dict[int, int] = {}        # id(TensorSpec) -> bytes (the plans hold them)
        self.links: Dict[Tuple[int, int], _Link] = {}      # (src, dst)
        self.groups: Dict[Tuple[int, ...], _Group] = {}    # sorted ranks
        self.ops, self.shown = {}, {}
        for r, plan in self.plans.items():
            self.ops[r], self.shown[r] = self._lower(r, plan)
        self.clock = {r: 0.0 for r in self.plans}
        self.pc = {r: 0 for r in self.plans}       # position in the plan repeated `steps` times
        self.starts = {r: array("d") for r in self.plans}
        self.ends = {r: array("d") for r in self.plans}
        self.delivered: Dict[int, float] = {r: 0.0 for r in self.plans}   # last send's arrival
        self.step_end: Dict[int, List[float]] = {r: [] for r in self.plans}
        self.running: List[int] = list(self.plans)     # the ranks run (representatives)
        self.rep: Dict[int, int] = {}                   # folded rank -> its representative
        self.waiting: Dict[Tuple[int, int], List[int]] = {}   # (rank, pc) -> ranks waiting
        self._args = (plans, costs, steps, cores)
        if fold and len(self.plans) > 2:
            self._fold(_Symmetry(self).classes())

    # -- each instruction once: what it shows as, and what the simulator does -----------
    def _lower(self, rank: int, plan: ExecutionPlan):
        ops, labels, kinds, mbs = [], [], [], []
        cache, shown = self._cache, self._shown_p2p
        for ins in plan.instructions:
            seen = cache.get(id(ins))
            if seen is None and type(ins) in (Send, Recv):   # per rank: only the op differs
                p2p = (type(ins), ins.stage, ins.direction, ins.microbatch)
                seen = shown.get(p2p) or shown.setdefault(p2p, (ins.label, ins.span_kind,
                                                                ins.microbatch, None))
            label, kind, mb, op = seen or self._describe(ins, rank)
            ops.append(op or self._op(ins, rank, kind))
            labels.append(label)
            kinds.append(kind)
            mbs.append(mb)
        return ops, (tuple(labels), tuple(kinds), tuple(mbs))

    def _describe(self, ins: Instruction, rank: int) -> tuple:
        """What an instruction shows as, and its op where that is alike on every rank
        (instruction objects are shared between ranks: see lower_plan, list_collectives)."""
        kind = ins.span_kind
        alike = kind not in ("send", "recv", "optimizer")
        out = (ins.label, kind, getattr(ins, "microbatch", None),
               self._op(ins, rank, kind) if alike else None)
        self._cache[id(ins)] = out
        return out

    def _op(self, ins: Instruction, rank: int, kind: str) -> tuple:
        costs = self.costs
        if kind == "send":
            pair = (rank, ins.peer)
            link = self.links.get(pair) or self._link(*pair)
            bandwidth, latency = self._wires.get(pair) or self._wires.setdefault(pair, costs.link(*pair))
            nbytes = self._nbytes(ins)
            return _SEND, costs.send_cost(nbytes), link, nbytes / bandwidth, latency
        if kind == "recv":
            return _RECV, self.links.get((ins.peer, rank)) or self._link(ins.peer, rank), \
                costs.recv_cost(self._nbytes(ins))
        if isinstance(ins, (AllReduce, Collective)):
            group = tuple(sorted(ins.ranks))
            if group not in self.groups:
                self.groups[group] = _Group(group)
            return _COLLECTIVE, self.groups[group], costs.collective(ins)
        if kind == "optimizer":
            return _OPTIMIZER, costs.compute(ins, rank) * self.stretch
        return _COMPUTE, costs.compute(ins, rank) * self.stretch

    def _nbytes(self, ins) -> int:
        """A transfer's bytes (its TensorSpecs are usually shared by many instructions)."""
        n, known = 0, self._bytes
        for t in ins.tensors:
            b = known.get(id(t))
            if b is None:
                b = known[id(t)] = t.nbytes
            n += b
        return n

    def _link(self, src: int, dst: int) -> "_Link":
        if (src, dst) not in self.links:
            self.links[(src, dst)] = _Link(src, dst)
        return self.links[(src, dst)]

    # -- running ------------------------------------------------------------------------
    def _fold(self, classes: List[List[int]]) -> None:
        """Runs one representative per class from now on (NOTE: Symmetric ranks)."""
        if len(classes) == len(self.plans):
            return
        rep = {r: c[0] for c in classes for r in c}
        self.running = [c[0] for c in classes]
        self.rep = {r: q for r, q in rep.items() if r != q}
        fanout: Dict[Tuple[int, int], list] = {}
        for r, q in self.rep.items():    # r's sends to representatives ride on q's sends
            for i, op in enumerate(self.ops[r]):
                if op[0] == _SEND and rep[op[2].dst] == op[2].dst:
                    fanout.setdefault((q, i), []).append((r, op))
        index_of = _collective_indices(self)
        for q in self.running:
            ops = self.ops[q] = list(self.ops[q])
            for i, op in enumerate(ops):
                if op[0] == _SEND and (q, i) in fanout:
                    ops[i] = (_FANOUT,) + op[1:] + (tuple(fanout[(q, i)]),)
                elif op[0] == _COLLECTIVE:
                    deps = {(rep[m], j) for m, j in index_of[(q, i)]}
                    ops[i] = (_QCOLLECTIVE, tuple(sorted(deps)), op[2])

    def run(self) -> None:
        ready = deque(self.running)
        while ready:
            ready.extend(self._advance(ready.popleft()))
        if any(self.pc[r] < len(self.plans[r].instructions) * self.steps for r in self.running):
            if self.rep:        # the folded run cannot finish: run every rank (and report)
                self.__init__(*self._args, fold=False)
                return self.run()
            self._stuck()
        for r, q in self.rep.items():   # a folded rank's times are its representative's
            self.starts[r], self.ends[r], self.step_end[r] = self.starts[q], self.ends[q], self.step_end[q]
            self.pc[r], self.clock[r], self.delivered[r] = self.pc[q], self.clock[q], self.delivered[q]

    def _advance(self, rank: int) -> List[int]:
        """Issues `rank`'s instructions until one must wait; returns the ranks it freed."""
        ops, n = self.ops[rank], len(self.ops[rank])
        total = n * self.steps
        pc, clock = self.pc[rank], self.clock[rank]
        starts, ends, freed = self.starts[rank], self.ends[rank], []
        while pc < total:
            index = pc % n
            op = ops[index]
            code = op[0]
            if code == _COMPUTE:
                end = clock + op[1]
            elif code == _SEND:
                end = clock + op[1]
                freed += self._post_send(rank, op, end)
            elif code == _RECV:
                end = self._recv_end(rank, op, clock)
            elif code == _COLLECTIVE:
                end = self._collective_end(rank, op, clock, freed)
            elif code == _FANOUT:
                end = clock + op[1]
                freed += self._post_send(rank, op, end)
                for other, other_op in op[5]:
                    freed += self._post_send(other, other_op, end)
            elif code == _QCOLLECTIVE:
                end = self._folded_collective_end(rank, op, pc, n, clock, freed)
            else:
                end = self._drained(rank, clock) + op[1]
            if end is None:
                break
            starts.append(clock)
            ends.append(end)
            clock = end
            pc += 1
            if index == n - 1:      # the runtime drains its sends before a step returns
                clock = self._drained(rank, end)
                self.step_end[rank].append(clock)
        self.pc[rank], self.clock[rank] = pc, clock
        return freed

    def _drained(self, rank: int, now: float) -> float:
        return max(now, self.delivered[rank]) if self.costs.sends_complete_on_delivery else now

    def _post_send(self, rank: int, op: tuple, now: float) -> List[int]:
        link, wire, latency = op[2], op[3], op[4]
        start = max(now, link.free)
        link.free = start + wire
        arrival = start + wire + latency
        link.arrivals.append(arrival)
        if arrival > self.delivered[rank]:
            self.delivered[rank] = arrival
        waiter, link.waiter = link.waiter, None
        return [waiter] if waiter is not None else []

    def _recv_end(self, rank: int, op: tuple, now: float) -> Optional[float]:
        _, link, cost = op
        if link.taken >= len(link.arrivals):
            link.waiter = rank
            return None
        arrival = link.arrivals[link.taken]
        link.taken += 1
        if arrival > now:       # the receiver waits, polling; it notices the data a bit late
            arrival += self.costs.noticed(arrival - now)
        return max(now, arrival) + cost

    def _collective_end(self, rank: int, op: tuple, now: float, freed: List[int]) -> Optional[float]:
        _, group, cost = op
        k = group.next_k.get(rank, 0)
        entry = group.open.get(k)
        if entry is None:
            entry = group.open[k] = _Issue()
        if entry.issued < group.size:      # this rank arrives (a woken rank had arrived before)
            entry.issued += 1
            entry.latest = max(entry.latest, now)
            if entry.issued < group.size:
                entry.waiters.append(rank)
                return None
            freed += entry.waiters
        group.next_k[rank] = k + 1
        entry.done += 1
        if entry.done == group.size:       # every member is through: forget it
            del group.open[k]
        return entry.latest + cost

    def _folded_collective_end(self, rank: int, op: tuple, pc: int, n: int, now: float,
                               freed: List[int]) -> Optional[float]:
        """A collective between representatives: each member's class's representative must
        have issued it at that member's index (NOTE: Symmetric ranks)."""
        freed += self.waiting.pop((rank, pc), ())
        step = pc // n
        latest = now
        for other, j in op[1]:
            target = step * len(self.ops[other]) + j
            at = pc if other == rank else self.pc[other]
            if at > target:
                issued = self.starts[other][target]
            elif at == target:
                issued = now if other == rank else self.clock[other]
            else:
                self.waiting.setdefault((other, target), []).append(rank)
                return None
            if issued > latest:
                latest = issued
        return latest + op[2]

    def _stuck(self) -> None:
        waits = []
        for r, p in self.plans.items():
            if self.pc[r] < len(p.instructions) * self.steps:
                step, index = divmod(self.pc[r], len(p.instructions))
                waits.append(f"rank {r} at #{index} `{p.instructions[index]}`"
                             + (f" (step {step})" if self.steps > 1 else ""))
        raise PlanError("simulation cannot finish: every unfinished rank waits on another: "
                        + "; ".join(waits) + ". Fix: run graphc.plan.verify.verify_plans(plans) "
                        "for the offending pair.")

    # -- results ------------------------------------------------------------------------
    def result(self) -> SimResult:
        ends = [max((e[k] for e in self.step_end.values() if len(e) > k), default=0.0)
                for k in range(self.steps)]
        if self.steps > 1:
            step = (ends[-1] - ends[0]) / (self.steps - 1)
        else:
            step = max((e[-1] for e in self.ends.values() if len(e)), default=0.0)
        ranks = [self._summary(r, step) for r in sorted(self.plans)]
        timeline = SimTimeline(self.plans, self.shown, self.starts, self.ends)
        return SimResult(timeline, step, ranks, ends, self.steps)

    def _summary(self, rank: int, step: float) -> RankSummary:
        kinds, ops = self.shown[rank][1], self.ops[rank]
        # compute spans last exactly their cost, alike in every step
        busy = sum(op[1] for op, kind in zip(ops, kinds) if kind in COMPUTE_KINDS)
        live = peak = 0
        for kind in kinds:
            if kind == "overlap":       # its forward's activations exist before its backward
                peak = max(peak, live + 1)
            live += _LIVE.get(kind, 0)
            peak = max(peak, live)
        if not self.plans[rank].training:
            peak = min(peak, 1)     # inference frees each micro-batch's activations at once
        stages = self.plans[rank].local_stages
        finish = self.step_end[rank][0] if self.step_end[rank] else 0.0
        bubble = 1.0 - busy / step if step > 0 and stages else 0.0
        return RankSummary(rank, stages, busy, finish, bubble, peak,
                           self._activation_peak(rank))

    def _activation_peak(self, rank: int) -> int:
        """activation_peak of the rank's plan; a folded rank's is its representative's where
        what it reads beyond the compute labels (alike in a class) is the same."""
        plan, peaks = self.plans[rank], self.__dict__.setdefault("_peaks", {})
        q = self.rep.get(rank)
        if q is not None and q in peaks:
            other = self.plans[q]
            if (plan.local_stages, plan.training, plan.checkpointing, plan.num_microbatches) == \
                    (other.local_stages, other.training, other.checkpointing, other.num_microbatches) \
                    and stage_input_bytes(plan, self.costs) == stage_input_bytes(other, self.costs):
                return peaks[q]
        peaks[rank] = activation_peak(plan, self.costs)
        return peaks[rank]


def _collective_indices(sim: "_Simulation") -> Optional[Dict[Tuple[int, int], tuple]]:
    """(rank, index of a collective) -> ((member, the index at which it issues the same
    call), ...); None where members issue a group's collectives unequally often."""
    if getattr(sim, "_coll_index", False) is not False:
        return sim._coll_index
    calls: Dict[int, Dict[int, List[int]]] = {}     # id(group) -> rank -> indices
    groups = {}
    for r, ops in sim.ops.items():
        for i, op in enumerate(ops):
            if op[0] == _COLLECTIVE:
                groups[id(op[1])] = op[1]
                calls.setdefault(id(op[1]), {}).setdefault(r, []).append(i)
    out: Optional[Dict[Tuple[int, int], tuple]] = {}
    for gid, per_rank in calls.items():
        members = groups[gid].ranks
        counts = {len(per_rank.get(m, ())) for m in members}
        if len(counts) != 1 or len(per_rank) != len(members):
            out = None
            break
        for k in range(counts.pop()):
            call = tuple((m, per_rank[m][k]) for m in members)
            for m, i in call:
                out[(m, i)] = call
    sim._coll_index = out
    return out


class _Symmetry:
    """Classes of ranks that share one simulated timeline (NOTE: Symmetric ranks)."""

    def __init__(self, sim: "_Simulation"):
        self.sim = sim
        self.ranks = sorted(sim.plans)

    def classes(self) -> List[List[int]]:
        alone = [[r] for r in self.ranks]
        match = self._matches()
        calls = _collective_indices(self.sim)
        if match is None or calls is None:
            return alone
        keys, p2p, coll = {}, {}, {}
        for r in self.ranks:
            keys[r], p2p[r], coll[r] = self._describe(r, match, calls)
        colour = _number(keys)
        count = len(set(colour.values()))
        while count < len(self.ranks):
            refined = _number({r: (colour[r],
                                   tuple((colour[q], j) for q, j in p2p[r]),
                                   tuple(tuple(sorted((colour[m], j) for m, j in call))
                                         for call in coll[r]))
                               for r in self.ranks})
            new_count = len(set(refined.values()))
            colour = refined
            if new_count == count:
                break
            count = new_count
        classes: Dict[int, List[int]] = {}
        for r in self.ranks:
            classes.setdefault(colour[r], []).append(r)
        return sorted(classes.values())

    def _matches(self) -> Optional[Dict[Tuple[int, int], Tuple[int, int]]]:
        """(rank, index of a send or recv) -> (peer, index of the recv or send it meets)."""
        sends: Dict[Tuple[int, int], List[int]] = {}
        recvs: Dict[Tuple[int, int], List[int]] = {}
        for r in self.ranks:
            for i, op in enumerate(self.sim.ops[r]):
                if op[0] == _SEND:
                    sends.setdefault((r, op[2].dst), []).append(i)
                elif op[0] == _RECV:
                    recvs.setdefault((op[1].src, r), []).append(i)
        if sends.keys() != recvs.keys() or any(len(v) != len(recvs[k]) for k, v in sends.items()):
            return None
        match = {}
        for (a, b), at_a in sends.items():
            for i, j in zip(at_a, recvs[(a, b)]):
                match[(a, i)], match[(b, j)] = (b, j), (a, i)
        return match

    def _describe(self, r: int, match, calls):
        """A rank's key without peers (costs, labels, its peers' pattern), its sends' and
        recvs' (peer, peer's index) and its collectives' (member, member's index) calls."""
        key, p2p, coll = [], [], []
        to, frm = {}, {}
        for i, op in enumerate(self.sim.ops[r]):
            code = op[0]
            if code == _SEND:
                key.append((code, op[1], op[3], op[4], to.setdefault(op[2].dst, len(to))))
                p2p.append(match[(r, i)])
            elif code == _RECV:
                key.append((code, op[2], frm.setdefault(op[1].src, len(frm))))
                p2p.append(match[(r, i)])
            elif code == _COLLECTIVE:
                key.append((code, op[1].size, op[2]))
                coll.append(calls[(r, i)])
            else:
                key.append(op)
        return (self.sim.shown[r], tuple(key)), p2p, coll


def _number(keys: Dict[int, object]) -> Dict[int, int]:
    """rank -> a small number per distinct key."""
    seen: Dict[object, int] = {}
    return {r: seen.setdefault(k, len(seen)) for r, k in keys.items()}
