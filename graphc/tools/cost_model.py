"""The simulator's cost parameters: seconds per instruction and the link model.

A CostModel is the one thing graphc/tools/costs.py (unit, measured or modelled costs),
graphc/tools/transport_costs.py (a measured transport applied to a model) and the
simulator share, so it lives here, below all three: costs.py imports transport_costs.py
to measure a transport, and neither needs the other for the record itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from ..plan.instructions import (AllGather, AllReduce, Backward, BackwardInput, BackwardWeight, Collective,
                                 Forward, Instruction, OptimizerStep, PrePass, ReduceScatter,
                                 TensorSpec)
from ..sbp.cost import moved_bytes
from .network import Network, collective_seconds
from .ring_overlap import overlaps, ring_step_seconds


# NOTE: Recompute cost
# A checkpointed micro-batch (ExecutionPlan.recomputed_microbatches) runs its forward again,
# recording, where the runtime does it: at the start of its backward, or of its backward's
# input half when the schedule splits it (StageExecutor._roots; compiled pieces recompute
# inside that same backward). So the simulator charges the recompute once, in that
# instruction (a DualPipeV OverlapFB through its backward part), at the stage's forward
# seconds (CostModel.recompute_cost): a modelled forward counts the same FLOPs and bytes a
# recording forward runs, and a measured one (measure_costs) was timed recording. Neither
# cost already holds it: device_costs' backward is twice its forward, and measure_costs
# replays a stage without checkpointing (its executor recomputes nothing), so nothing is
# charged twice. The checkpointed forward itself is charged as any forward.
RECOMPUTING_RUNS = frozenset({"backward", "backward_input"})


def _interpolated(points: List[Tuple[float, float]], x: float, beyond: float) -> float:
    """y at x > 0 on the line through (x, y) points sorted by x (from (0, 0) before the
    first; `beyond` after the last)."""
    if x <= points[0][0]:
        return points[0][1] * x / points[0][0] if points[0][0] > 0 else points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return beyond


@dataclass(frozen=True)
class PrologueCost:
    """One stage's Prologue (plan/program.py) per step, which runs before the plan's first
    instruction and outside it: its module over every micro-batch, then one blocking
    all-reduce per value whose inputs are split over ranks (NOTE: Prologue costs)."""

    seconds: float                                  # the module, summed over the micro-batches
    # per all-reduced value: (the mesh groups it is summed over, its bytes)
    reduces: Tuple[Tuple[Tuple[Tuple[int, ...], ...], int], ...] = ()


@dataclass
class CostModel:
    """Seconds per instruction and link parameters (see graphc/tools/simulate/ for how they are used)."""

    forward: Dict[int, float]                       # stage -> seconds per micro-batch
    backward: Dict[int, float]
    optimizer: Dict[int, float] = field(default_factory=dict)
    activation_bytes: Dict[int, int] = field(default_factory=dict)  # stage -> per micro-batch
    latency: float = 0.0                            # seconds per transfer
    bandwidth: float = float("inf")                 # bytes per second
    send_overhead: float = 0.0                      # seconds a send occupies the sender
    recv_overhead: float = 0.0                      # seconds a recv occupies the receiver
    send_per_byte: float = 0.0                      # + seconds per byte on the sender
    recv_per_byte: float = 0.0                      # + seconds per byte on the receiver
    sends_complete_on_delivery: bool = False        # gloo: draining sends waits for delivery
    # (seconds the receiver has waited, extra seconds until it notices the data): a
    # polling receiver backs off while it waits, so a long wait ends late; interpolated
    poll_delay: List[Tuple[float, float]] = field(default_factory=list)
    overhead: float = 0.0                           # seconds the runtime adds per compute
    source: str = "uniform"
    stage_of_rank: Dict[int, int] = field(default_factory=dict)  # for the optimizer's cost
    backward_input: Dict[int, float] = field(default_factory=dict)   # measured halves of a
    backward_weight: Dict[int, float] = field(default_factory=dict)  # split backward, if any
    # bytes of each stage's inputs per micro-batch: what a checkpointed micro-batch keeps
    # (stages missing here: what the plan receives for them)
    input_bytes: Dict[int, int] = field(default_factory=dict)
    # links between nodes (None: every pair of ranks has the link above)
    network: Optional[Network] = None
    # (bandwidth, latency) of collectives where they take another path than sends (measured
    # costs: sends use the measured transport, collectives gloo); None: the link above
    collective_link: Optional[Tuple[float, float]] = None
    # seconds of host time each member spends on one collective call, whatever its bytes
    # (CPU ranks: the hand-off between ranks; NOTE: Shared cores)
    collective_overhead: float = 0.0
    # cores the ranks of one node (network.ranks_per_node; all ranks without a network)
    # share: the step is then at least their summed busy time over it (NOTE: Shared cores);
    # None: every rank has a device or core of its own
    cores: Optional[float] = None
    # (stage, attention node) -> forward seconds of one ring block on a rank: its steps'
    # transfers run beside it (NOTE: Ring overlap, tools/ring_overlap.py); empty: in turn
    ring_blocks: Dict[Tuple[int, str], float] = field(default_factory=dict)
    # seconds a rank's wait costs where ranks share cores: the baton handed to another rank
    # when a receive's data or a collective's other members are not there yet (a local
    # world's thread switch); a transfer whose data is there costs only send/recv_overhead
    # (NOTE: Shared cores)
    handoff: float = 0.0
    # stage -> its Prologue's cost per step (NOTE: Prologue costs); stages without one absent
    prologue: Dict[int, PrologueCost] = field(default_factory=dict)
    # stage -> seconds of a checkpointed micro-batch's recomputed forward where it is not the
    # stage's `forward` (NOTE: Recompute cost); stages missing here: their `forward`
    recompute: Dict[int, float] = field(default_factory=dict)
    # (seconds of compute since the members last synchronised, extra seconds a collective then
    # takes): their drift apart, measured in context (NOTE: Collectives in context); empty: none
    collective_skew: List[Tuple[float, float]] = field(default_factory=list)

    @staticmethod
    def uniform(num_stages: int, forward: float = 1.0, backward: float = 2.0) -> "CostModel":
        """Equal stages, free communication: the textbook setting of bubble formulas."""
        return CostModel({s: forward for s in range(num_stages)},
                         {s: backward for s in range(num_stages)})

    def compute(self, ins: Instruction, rank: int, recomputed: FrozenSet[int] = frozenset()) -> float:
        """Seconds of compute `ins` takes on `rank`, by the run entry its class names (`runs`,
        plan/instructions.py): a kind whose entry has no cost here computes nothing.

        recomputed: the micro-batches whose forward the backward runs again (the plan's
        `recomputed_microbatches`): their Backward or BackwardInput also costs that forward
        (See NOTE: Recompute cost)."""
        if ins.runs == "overlap":     # DualPipeV's pair: its forward, then its backward
            return sum(self.compute(part, rank, recomputed) for part in ins.parts)
        cost = getattr(self, f"_cost_{ins.runs}", None)
        seconds = cost(ins, rank) if cost is not None else 0.0
        if ins.runs in RECOMPUTING_RUNS and ins.microbatch in recomputed:
            seconds += self.recompute_cost(ins.stage)
        return seconds

    def recompute_cost(self, stage: int) -> float:
        """Seconds of a checkpointed micro-batch's forward run again, recording, inside its
        backward (See NOTE: Recompute cost)."""
        return self.recompute.get(stage, self.forward.get(stage, 0.0))

    def _cost_forward(self, ins: Forward, rank: int) -> float:
        return self.forward.get(ins.stage, 0.0) + self.overhead

    def _cost_pre_pass(self, ins: PrePass, rank: int) -> float:
        """A forward's: the pre-pass runs at most the stage's forward, without autograd
        (NOTE: Whole-batch sums)."""
        return self.forward.get(ins.stage, 0.0) + self.overhead

    def _cost_backward(self, ins: Backward, rank: int) -> float:
        return self.backward.get(ins.stage, 0.0) + self.overhead

    def _cost_backward_input(self, ins: BackwardInput, rank: int) -> float:
        return self._half(self.backward_input, ins.stage) + self.overhead

    def _cost_backward_weight(self, ins: BackwardWeight, rank: int) -> float:
        return self._half(self.backward_weight, ins.stage) + self.overhead

    def _cost_optimizer_step(self, ins: OptimizerStep, rank: int) -> float:
        return self.optimizer.get(self.stage_of_rank.get(rank, -1), 0.0)

    def _half(self, measured: Dict[int, float], stage: int) -> float:
        return measured[stage] if stage in measured else self.backward.get(stage, 0.0) / 2

    def step_start(self, rank: int, stages: Sequence[int]) -> float:
        """Seconds `rank` spends before its plan's first instruction each step: the Prologues
        of its `stages` and their all-reduces (See NOTE: Prologue costs)."""
        total = 0.0
        for s in stages:
            pro = self.prologue.get(s)
            if pro is None:
                continue
            total += pro.seconds
            for groups, nbytes in pro.reduces:
                group = next((g for g in groups if rank in g), groups[0])
                total += self._scalar_sum(tuple(group), nbytes)
        return total

    def step_start_syncs(self, rank: int, stages: Sequence[int]) -> int:
        """How many all-reduces over more than one rank `rank`'s Prologues run each step."""
        count = 0
        for s in stages:
            pro = self.prologue.get(s)
            for groups, _ in (pro.reduces if pro is not None else ()):
                count += len(next((g for g in groups if rank in g), groups[0])) > 1
        return count

    def _scalar_sum(self, group: Tuple[int, ...], nbytes: int) -> float:
        n = len(group)
        if n < 2:
            return 0.0
        spec = TensorSpec("prologue", (max(nbytes // 8, 1),), "float64")
        return self.collective(AllReduce(group, (spec,)))

    def link(self, src: int, dst: int) -> Tuple[float, float]:
        """(bandwidth, latency) of the link from rank src to rank dst."""
        if self.network is not None and self.network.crosses((src, dst)):
            return self.network.bandwidth, self.network.latency
        return self.bandwidth, self.latency

    def send_cost(self, nbytes: int) -> float:
        """CPU seconds one send occupies the sending rank."""
        return self.send_overhead + nbytes * self.send_per_byte

    def recv_cost(self, nbytes: int) -> float:
        """CPU seconds one recv occupies the receiving rank once its data has arrived."""
        return self.recv_overhead + nbytes * self.recv_per_byte

    def noticed(self, waited: float) -> float:
        """Extra seconds before a receiver that has waited `waited` seconds sees its data."""
        pts = self.poll_delay
        if waited <= 0 or not pts:
            return 0.0
        return _interpolated(pts, waited, pts[-1][1])

    def skew(self, computed: float) -> float:
        """Extra seconds of a collective whose members each computed up to `computed` seconds
        since they last synchronised (See NOTE: Collectives in context): interpolated between
        the measured points, in proportion to the last one beyond it."""
        pts = self.collective_skew
        if computed <= 0 or not pts:
            return 0.0
        last_compute, last_extra = pts[-1]
        beyond = last_extra * computed / last_compute if last_compute > 0 else last_extra
        return _interpolated(pts, computed, beyond)

    def collective(self, ins) -> float:
        """Seconds of a gradient bucket, tie or clip all-reduce, or a boxing collective, from
        the faster of a ring and a tree over the group's slowest link (graphc/tools/network.py,
        NOTE: Collective costs)."""
        n = len(ins.ranks)
        if n < 2:
            return 0.0
        return self.collective_overhead + self._collective_transfer(ins, n)

    def _collective_transfer(self, ins, n: int) -> float:
        link = self.collective_link or (self.bandwidth, self.latency)
        if self.network is not None and self.network.crosses(ins.ranks):
            link = (self.network.bandwidth, self.network.latency)
        if isinstance(ins, Collective) and (ins.stage, ins.node) in self.ring_blocks and overlaps(ins):
            return ring_step_seconds(ins, self.ring_blocks[(ins.stage, ins.node)], link)
        if isinstance(ins, Collective):     # nbytes: what this rank sends in the ring
            whole = ins.nbytes * n // (2 * (n - 1)) if ins.kind == "all_reduce" else 0
            return collective_seconds(ins.kind, ins.nbytes, whole, n, link)
        if type(ins) in (ReduceScatter, AllGather):   # ZeRO's: half a ring all-reduce each
            return collective_seconds(ins.op, ins.sent_bytes(), 0, n, link)
        whole = sum(t.nbytes for t in ins.tensors)
        return collective_seconds("all_reduce", moved_bytes("all_reduce", whole, n), whole, n, link)
