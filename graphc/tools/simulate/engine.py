"""The simulation's event engine: every rank's plan run against a CostModel.

The ranks run from a worklist: a rank moves on until it must wait for a message or a
collective, and the rank that satisfies the wait puts it back on the list, so the work is
linear in the number of instructions times steps (a thousand ranks, four steps: two
million instructions). The times land in one array per rank; `SimResult.timeline` builds
a rank's Spans when asked, and `signature(rank)` compares ranks without building them.
"""
from __future__ import annotations

from array import array
from collections import deque
from typing import Dict, List, Optional, Sequence, Tuple

from ...errors import PlanError
from ...plan.instructions import Instruction, Recv, Send
from ...plan.plan import ExecutionPlan
from ...runtime.trace import COMPUTE_KINDS
from ..cost_model import CostModel
from .codes import COLLECTIVE, COMPUTE, FANOUT, OPTIMIZER, QCOLLECTIVE, RECV, SEND
from . import folding
from .memory import activation_peak, peak_live_microbatches, stage_input_bytes
from .result import RankSummary, SimResult, SimTimeline


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

    __slots__ = ("issued", "latest", "done", "waiters", "computed")

    def __init__(self):
        self.issued, self.latest, self.done, self.waiters = 0, 0.0, 0, []
        self.computed = 0.0     # the most compute a member did since its last collective


class _Group:
    """The collectives over one group of ranks, matched in issue order."""

    __slots__ = ("ranks", "size", "next_k", "open")

    def __init__(self, ranks: Tuple[int, ...]):
        self.ranks, self.size = ranks, len(ranks)
        self.next_k: Dict[int, int] = {}    # rank -> the number of its next collective here
        self.open: Dict[int, _Issue] = {}


class _Simulation:
    """Every rank's plan lowered to op tuples (codes.py) and run from a worklist; with
    `fold`, one representative per class of symmetric ranks (folding.py)."""

    def __init__(self, plans: Sequence[ExecutionPlan], costs: CostModel, steps: int = 1,
                 cores: Optional[int] = None, fold: bool = True, members=None,
                 computing: Optional[int] = None):
        """members: group -> the ranks that issue its collectives here (default all of them;
        a world of templates: its templates, NOTE: Simulated classes); computing: the ranks
        that compute, for `cores` (default those of `plans`)."""
        self.plans = {p.rank: p for p in plans}
        self.costs, self.steps = costs, steps
        self._members = members or (lambda group: group)
        self._options = dict(members=members, computing=computing)
        if computing is None:
            computing = sum(1 for p in plans if p.local_stages)
        self.stretch = max(1.0, computing / cores) if cores else 1.0
        self._cache: Dict[int, tuple] = {}      # id(instruction) -> (label, kind, mb, op)
        self._shown_p2p: Dict[tuple, tuple] = {}   # (type, stage, direction, mb) -> shown
        self._wires: Dict[Tuple[int, int], Tuple[float, float]] = {}   # (src, dst) -> link
        self._bytes: Dict[int, int] = {}        # id(TensorSpec) -> bytes (the plans hold them)
        self.links: Dict[Tuple[int, int], _Link] = {}      # (src, dst)
        self.groups: Dict[Tuple[int, ...], _Group] = {}    # sorted ranks
        self.ops, self.shown = {}, {}
        # each rank's checkpointed micro-batches, charged their forward again (NOTE: Recompute cost)
        self._recomputed = {r: p.recomputed_microbatches for r, p in self.plans.items()}
        for r, plan in self.plans.items():
            self.ops[r], self.shown[r] = self._lower(r, plan)
        # each step begins with the rank's Prologues, outside its plan (NOTE: Prologue costs)
        self.step_start = {r: costs.step_start(r, p.local_stages) if costs.prologue else 0.0
                           for r, p in self.plans.items()}
        self.clock = dict(self.step_start)
        # the Prologues' all-reduces: their members' drift is charged (NOTE: Collectives in context)
        self.start_syncs = {r: costs.step_start_syncs(r, p.local_stages) if costs.prologue else 0
                            for r, p in self.plans.items()}
        self.skew = costs.skew if costs.collective_skew else None
        self.computed = {r: 0.0 for r in self.plans}   # compute since the rank's last collective
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
            folding.fold(self, folding.Symmetry(self).classes())

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
            return SEND, costs.send_cost(nbytes), link, nbytes / bandwidth, latency
        if kind == "recv":
            return RECV, self.links.get((ins.peer, rank)) or self._link(ins.peer, rank), \
                costs.recv_cost(self._nbytes(ins))
        if kind == "collective":   # by its class's span_kind, as send, recv and optimizer above
            group = tuple(sorted(ins.ranks))
            if group not in self.groups:
                self.groups[group] = _Group(self._members(group))
            return COLLECTIVE, self.groups[group], costs.collective(ins)
        if kind == "optimizer":
            return OPTIMIZER, costs.compute(ins, rank) * self.stretch
        # a checkpointed micro-batch's backward runs its forward again (NOTE: Recompute cost)
        return COMPUTE, costs.compute(ins, rank, self._recomputed[rank]) * self.stretch

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
    def run(self) -> None:
        ready = deque(self.running)
        while ready:
            ready.extend(self._advance(ready.popleft()))
        if any(self.pc[r] < len(self.plans[r].instructions) * self.steps for r in self.running):
            if self.rep:        # the folded run cannot finish: run every rank (and report)
                self.__init__(*self._args, fold=False, **self._options)
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
        track = self.skew is not None      # compute since the last collective, for its drift
        while pc < total:
            index = pc % n
            op = ops[index]
            code = op[0]
            if code == COMPUTE:
                end = clock + op[1]
                if track:
                    self.computed[rank] += op[1]
            elif code == SEND:
                end = clock + op[1]
                freed += self._post_send(rank, op, end)
            elif code == RECV:
                end = self._recv_end(rank, op, clock)
            elif code == COLLECTIVE:
                end = self._collective_end(rank, op, clock, freed)
            elif code == FANOUT:
                end = clock + op[1]
                freed += self._post_send(rank, op, end)
                for other, other_op in op[5]:
                    freed += self._post_send(other, other_op, end)
            elif code == QCOLLECTIVE:
                end = self._folded_collective_end(rank, op, pc, n, clock, freed)
            else:
                end = self._drained(rank, clock) + op[1]
                if track:
                    self.computed[rank] += op[1]
            if end is None:
                break
            if track and (code == COLLECTIVE or code == QCOLLECTIVE):
                self.computed[rank] = 0.0
            starts.append(clock)
            ends.append(end)
            clock = end
            pc += 1
            if index == n - 1:      # the runtime drains its sends before a step returns
                clock = self._drained(rank, end)
                self.step_end[rank].append(clock)
                clock += self.step_start[rank] + self._prologue_skew(rank)
        self.pc[rank], self.clock[rank] = pc, clock
        return freed

    def _prologue_skew(self, rank: int) -> float:
        """The drift the first of a step's Prologue all-reduces pays (the others follow it at
        once; See NOTE: Collectives in context)."""
        if not self.start_syncs[rank] or self.skew is None:
            return 0.0
        pro = sum(self.costs.prologue[s].seconds for s in self.plans[rank].local_stages
                  if s in self.costs.prologue)
        extra = self.skew(self.computed[rank] + pro)
        self.computed[rank] = 0.0
        return extra

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
            entry.computed = max(entry.computed, self.computed[rank])
            if entry.issued < group.size:
                entry.waiters.append(rank)
                return None
            freed += entry.waiters
        group.next_k[rank] = k + 1
        entry.done += 1
        if entry.done == group.size:       # every member is through: forget it
            del group.open[k]
        return entry.latest + cost + (self.skew(entry.computed) if self.skew is not None else 0.0)

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
        # symmetric members (NOTE: Symmetric ranks): this one's compute stands for theirs
        return latest + op[2] + (self.skew(self.computed[rank]) if self.skew is not None else 0.0)

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
        peak = peak_live_microbatches(kinds, self.plans[rank].training)
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
