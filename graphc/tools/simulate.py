"""simulate(): predicts a step's timeline from every rank's plan and per-instruction costs.

Each rank issues its instructions in plan order, one at a time, as the runtime does:
  * compute takes its measured cost (CostModel.compute);
  * a send occupies the SENDER for send_overhead + bytes * send_per_byte (the CPU the
    transport spends in isend: a memcpy into the shared-memory ring, or gloo's hand-off),
    then its data arrives at the peer after the link's latency plus bytes / bandwidth
    (transfers on one directed link queue behind each other);
  * a recv ends recv_overhead + bytes * recv_per_byte after its data has arrived or it
    was issued, whichever is later (the runtime posts receives ahead, so only the wait and
    the copy out are charged); a receiver that had to wait notices the data
    `costs.noticed(wait)` late (a polling receiver backs off while it waits);
  * a collective starts when its last member issues it;
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

Example:
    from graphc.tools.costs import CostModel
    result = simulate(compiled.plans, CostModel.uniform(num_stages=4))
    print(result.table())
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import PlanError
from ..plan.instructions import AllReduce, Backward, Forward, Instruction, OptimizerStep, Recv, Send
from ..plan.plan import ExecutionPlan
from .costs import CostModel


@dataclass(frozen=True)
class Span:
    """One instruction on one rank's timeline (seconds, or cost units for unit costs)."""

    rank: int
    index: int
    label: str
    kind: str                  # forward | backward | send | recv | collective | optimizer
    microbatch: Optional[int]
    start: float
    end: float
    step: int = 0              # which step (simulate(..., steps=n) runs several)


Timeline = Dict[int, List[Span]]


@dataclass
class RankSummary:
    rank: int
    stages: List[int]
    busy: float                # time spent in forward/backward compute
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


def kind_of(ins: Instruction) -> str:
    if isinstance(ins, Forward):
        return "forward"
    if isinstance(ins, Backward):
        return "backward"
    if isinstance(ins, Send):
        return "send"
    if isinstance(ins, Recv):
        return "recv"
    if isinstance(ins, OptimizerStep):
        return "optimizer"
    return "collective"


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


class _Simulation:
    def __init__(self, plans: Sequence[ExecutionPlan], costs: CostModel, steps: int = 1,
                 cores: Optional[int] = None):
        self.plans = {p.rank: p for p in plans}
        self.costs, self.steps = costs, steps
        computing = sum(1 for p in plans if p.local_stages)
        self.stretch = max(1.0, computing / cores) if cores else 1.0
        self.clock = {r: 0.0 for r in self.plans}
        self.pc = {r: 0 for r in self.plans}       # position in the plan repeated `steps` times
        self.timeline: Timeline = {r: [] for r in self.plans}
        self.arrivals: Dict[Tuple[int, int], List[float]] = defaultdict(list)   # (src, dst)
        self.taken: Dict[Tuple[int, int], int] = defaultdict(int)
        self.link_free: Dict[Tuple[int, int], float] = defaultdict(float)
        self.delivered: Dict[int, float] = defaultdict(float)   # rank -> its last send's arrival
        self.collectives: Dict[Tuple[int, ...], Dict[int, List[float]]] = defaultdict(lambda: defaultdict(list))
        self.coll_done: Dict[Tuple[int, ...], Dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.step_end: Dict[int, List[float]] = {r: [] for r in self.plans}

    def _total(self, rank: int) -> int:
        return len(self.plans[rank].instructions) * self.steps

    def run(self) -> None:
        while any(self.pc[r] < self._total(r) for r in self.plans):
            if not any(self._advance(r) for r in self.plans):
                self._stuck()

    def _advance(self, rank: int) -> bool:
        """Issues as many of `rank`'s instructions as can complete; True if any did."""
        moved = False
        plan = self.plans[rank]
        n = len(plan.instructions)
        while self.pc[rank] < self._total(rank):
            step, index = divmod(self.pc[rank], n)
            ins = plan.instructions[index]
            end = self._end_time(rank, ins)
            if end is None:
                break
            start = self.clock[rank]
            self.timeline[rank].append(Span(rank, index, str(ins).split(" ")[0], kind_of(ins),
                                            getattr(ins, "microbatch", None), start, end, step))
            self.clock[rank] = end
            self.pc[rank] += 1
            if index == n - 1:      # the runtime drains its sends before a step returns
                self.clock[rank] = self._drained(rank, end)
                self.step_end[rank].append(self.clock[rank])
            moved = True
        return moved

    def _drained(self, rank: int, now: float) -> float:
        return max(now, self.delivered[rank]) if self.costs.sends_complete_on_delivery else now

    def _end_time(self, rank: int, ins: Instruction) -> Optional[float]:
        """When `ins` ends if issued now on `rank`, or None while it must wait on another rank."""
        now = self.clock[rank]
        if isinstance(ins, Send):
            end = now + self.costs.send_cost(ins.nbytes)
            self._post_send(rank, ins, end)
            return end
        if isinstance(ins, Recv):
            return self._recv_end(rank, ins, now)
        if isinstance(ins, AllReduce):
            return self._collective_end(rank, ins, now)
        if isinstance(ins, OptimizerStep):
            now = self._drained(rank, now)
        return now + self.costs.compute(ins, rank) * self.stretch

    def _post_send(self, rank: int, ins: Send, now: float) -> None:
        link = (rank, ins.peer)
        start = max(now, self.link_free[link])
        wire = ins.nbytes / self.costs.bandwidth
        self.link_free[link] = start + wire
        arrival = start + wire + self.costs.latency
        self.arrivals[link].append(arrival)
        self.delivered[rank] = max(self.delivered[rank], arrival)

    def _recv_end(self, rank: int, ins: Recv, now: float) -> Optional[float]:
        link = (ins.peer, rank)
        k = self.taken[link]
        if k >= len(self.arrivals[link]):
            return None
        self.taken[link] += 1
        arrival = self.arrivals[link][k]
        if arrival > now:       # the receiver waits, polling; it notices the data a bit late
            arrival += self.costs.noticed(arrival - now)
        return max(now, arrival) + self.costs.recv_cost(ins.nbytes)

    def _collective_end(self, rank: int, ins: AllReduce, now: float) -> Optional[float]:
        issued = self.collectives[ins.ranks][rank]
        k = self.coll_done[ins.ranks][rank]
        if len(issued) <= k:
            issued.append(now)
        waiting = [self.collectives[ins.ranks][r] for r in ins.ranks]
        if any(len(w) <= k for w in waiting):
            return None
        self.coll_done[ins.ranks][rank] += 1
        return max(w[k] for w in waiting) + self.costs.all_reduce(ins)

    def _stuck(self) -> None:
        waits = []
        for r, p in self.plans.items():
            if self.pc[r] < self._total(r):
                step, index = divmod(self.pc[r], len(p.instructions))
                waits.append(f"rank {r} at #{index} `{p.instructions[index]}`"
                             + (f" (step {step})" if self.steps > 1 else ""))
        raise PlanError("simulation cannot finish: every unfinished rank waits on another: "
                        + "; ".join(waits) + ". Fix: run graphc.plan.verify.verify_plans(plans) "
                        "for the offending pair.")

    def result(self) -> SimResult:
        ends = [max((e[k] for e in self.step_end.values() if len(e) > k), default=0.0)
                for k in range(self.steps)]
        if self.steps > 1:
            step = (ends[-1] - ends[0]) / (self.steps - 1)
        else:
            step = max((s.end for spans in self.timeline.values() for s in spans), default=0.0)
        ranks = [self._summary(r, step) for r in sorted(self.plans)]
        return SimResult(self.timeline, step, ranks, ends, self.steps)

    def _summary(self, rank: int, step: float) -> RankSummary:
        spans = self.timeline[rank]
        busy = sum(s.end - s.start for s in spans if s.kind in ("forward", "backward")) / self.steps
        live = peak = 0
        for s in spans:
            live += 1 if s.kind == "forward" else -1 if s.kind == "backward" else 0
            peak = max(peak, live)
        if not self.plans[rank].training:
            peak = min(peak, 1)     # inference frees each micro-batch's activations at once
        stages = self.plans[rank].local_stages
        act = sum(self.costs.activation_bytes.get(s, 0) for s in stages)
        finish = self.step_end[rank][0] if self.step_end[rank] else 0.0
        bubble = 1.0 - busy / step if step > 0 and stages else 0.0
        return RankSummary(rank, stages, busy, finish, bubble, peak, peak * act)
