"""simulate(): predicts a step's timeline from every rank's plan and per-instruction costs.

Each rank issues its instructions in plan order, one at a time, as the runtime does:
compute takes its cost; a send costs the sender `send_overhead` and its data arrives at
the peer after the link's latency plus bytes / bandwidth (transfers on one directed link
queue behind each other); a recv ends when its data has arrived (the runtime posts
receives ahead, so only the wait is charged); a collective starts when its last member
issues it. Times therefore follow the plans' dependency graph exactly, which is what an
event-driven simulation of this model computes. Link contention between different
rank pairs and compute/communication interference are not modelled.

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
    step_time: float
    ranks: List[RankSummary] = field(default_factory=list)

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
        rows.append(f"step time {self.step_time * scale:.3f} {unit}, mean bubble "
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


def simulate(plans: Sequence[ExecutionPlan], costs: CostModel) -> SimResult:
    """Runs every rank's plan against `costs`; returns the timeline and per-rank summary.

    Args:
        plans: one ExecutionPlan per rank (CompiledGraph.plans), verified or not.
        costs: per-stage compute costs, link latency/bandwidth, activation sizes.
    Returns:
        SimResult with `step_time`, `bubble_fraction`, `ranks` and `timeline`.
    Raises:
        PlanError if the plans cannot finish (a recv or collective that nothing satisfies).
    """
    sim = _Simulation(plans, costs)
    sim.run()
    return sim.result()


class _Simulation:
    def __init__(self, plans: Sequence[ExecutionPlan], costs: CostModel):
        self.plans = {p.rank: p for p in plans}
        self.costs = costs
        self.clock = {r: 0.0 for r in self.plans}
        self.pc = {r: 0 for r in self.plans}
        self.timeline: Timeline = {r: [] for r in self.plans}
        self.arrivals: Dict[Tuple[int, int], List[float]] = defaultdict(list)   # (src, dst)
        self.taken: Dict[Tuple[int, int], int] = defaultdict(int)
        self.link_free: Dict[Tuple[int, int], float] = defaultdict(float)
        self.collectives: Dict[Tuple[int, ...], Dict[int, List[float]]] = defaultdict(lambda: defaultdict(list))
        self.coll_done: Dict[Tuple[int, ...], Dict[int, int]] = defaultdict(lambda: defaultdict(int))

    def run(self) -> None:
        while any(self.pc[r] < len(p.instructions) for r, p in self.plans.items()):
            if not any(self._advance(r) for r in self.plans):
                self._stuck()

    def _advance(self, rank: int) -> bool:
        """Issues as many of `rank`'s instructions as can complete; True if any did."""
        moved = False
        plan = self.plans[rank]
        while self.pc[rank] < len(plan.instructions):
            ins = plan.instructions[self.pc[rank]]
            end = self._end_time(rank, ins)
            if end is None:
                break
            start = self.clock[rank]
            self.timeline[rank].append(Span(rank, self.pc[rank], str(ins).split(" ")[0], kind_of(ins),
                                            getattr(ins, "microbatch", None), start, end))
            self.clock[rank] = end
            self.pc[rank] += 1
            moved = True
        return moved

    def _end_time(self, rank: int, ins: Instruction) -> Optional[float]:
        """When `ins` ends if issued now on `rank`, or None while it must wait on another rank."""
        now = self.clock[rank]
        if isinstance(ins, Send):
            self._post_send(rank, ins, now)
            return now + self.costs.send_overhead
        if isinstance(ins, Recv):
            return self._recv_end(rank, ins, now)
        if isinstance(ins, AllReduce):
            return self._collective_end(rank, ins, now)
        return now + self.costs.compute(ins, rank)

    def _post_send(self, rank: int, ins: Send, now: float) -> None:
        link = (rank, ins.peer)
        start = max(now, self.link_free[link])
        wire = ins.nbytes / self.costs.bandwidth
        self.link_free[link] = start + wire
        self.arrivals[link].append(start + wire + self.costs.latency)

    def _recv_end(self, rank: int, ins: Recv, now: float) -> Optional[float]:
        link = (ins.peer, rank)
        k = self.taken[link]
        if k >= len(self.arrivals[link]):
            return None
        self.taken[link] += 1
        return max(now, self.arrivals[link][k]) + self.costs.recv_overhead

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
        waits = [f"rank {r} at #{self.pc[r]} `{p.instructions[self.pc[r]]}`"
                 for r, p in self.plans.items() if self.pc[r] < len(p.instructions)]
        raise PlanError("simulation cannot finish: every unfinished rank waits on another: "
                        + "; ".join(waits) + ". Fix: run graphc.plan.verify.verify_plans(plans) "
                        "for the offending pair.")

    def result(self) -> SimResult:
        step = max((s.end for spans in self.timeline.values() for s in spans), default=0.0)
        ranks = [self._summary(r, step) for r in sorted(self.plans)]
        return SimResult(self.timeline, step, ranks)

    def _summary(self, rank: int, step: float) -> RankSummary:
        spans = self.timeline[rank]
        busy = sum(s.end - s.start for s in spans if s.kind in ("forward", "backward"))
        live = peak = 0
        for s in spans:
            live += 1 if s.kind == "forward" else -1 if s.kind == "backward" else 0
            peak = max(peak, live)
        if not self.plans[rank].training:
            peak = min(peak, 1)     # inference frees each micro-batch's activations at once
        stages = self.plans[rank].local_stages
        act = sum(self.costs.activation_bytes.get(s, 0) for s in stages)
        finish = spans[-1].end if spans else 0.0
        bubble = 1.0 - busy / step if step > 0 and stages else 0.0
        return RankSummary(rank, stages, busy, finish, bubble, peak, peak * act)
