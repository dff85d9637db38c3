"""The least step time of ranks that share a node's cores.

NOTE: Shared cores
The simulator gives each rank its own device: ranks compute at the same time. CPU ranks on
one host share its cores, and the ranks of a local world (threads of one process) run one
at a time (NOTE: Local world), so a step can be no shorter than the work of a node's ranks
divided by the cores they share: with C cores and R > C busy ranks, the layout that does
the least total work is the fastest, even where its critical path is longer (8 ranks of a
tiny model on 2 cores: data parallelism's replicated work against a pipeline's bubble).
A rank's work here is its host time: each compute's cost, each send's and receive's CPU
cost, each collective's whole cost (on a shared host its copies and sums take a core), its
Prologues (NOTE: Prologue costs), and a hand-off (`CostModel.handoff`) per wait: where
ranks take turns on a core, a receive whose data is not there yet, or a collective whose
other members have not all joined, gives the core to another rank, and that switch costs
time a transfer whose data is there does not (a local world's 2-rank ping-pong measured
180-280 us per message at load 7, the same messages sent ahead and then received 4 us;
benchmarks/cpu_calibration.py). Which operations wait is counted by running the plans one
rank at a time, each until it must wait (graphc/tools/one_at_a_time.py), as a local world
runs them: a pipeline's rank then runs ahead through its warm-up and rarely waits, a
data-parallel group waits at every collective in all members but the last.
`simulate` takes the larger of its timeline's step and this bound where the CostModel
says how many cores (`CostModel.cores`; the `cpu` preset's `cores_per_node`,
graphc/tools/network.py). It is a lower bound: ranks that wait leave cores idle, which
the timeline's critical path, not this bound, accounts for.
"""
from __future__ import annotations

from typing import Dict, Sequence

from ..plan.plan import ExecutionPlan
from .cost_model import CostModel
from .one_at_a_time import waits_one_at_a_time


def rank_work(plan: ExecutionPlan, costs: CostModel) -> float:
    """Seconds of host time one step of `plan` takes on its rank, its waits' hand-offs aside
    (See NOTE: Shared cores)."""
    total = costs.step_start(plan.rank, plan.local_stages) if costs.prologue else 0.0
    recomputed = plan.recomputed_microbatches    # NOTE: Recompute cost
    for ins in plan.instructions:
        if ins.runs == "send":
            total += costs.send_cost(sum(t.nbytes for t in ins.tensors))
        elif ins.runs == "recv":
            total += costs.recv_cost(sum(t.nbytes for t in ins.tensors))
        elif ins.joins:    # a collective (its class's group entry), as the engine charges it
            total += costs.collective(ins)
        else:
            total += costs.compute(ins, plan.rank, recomputed)
    return total


def shared_core_floor(plans: Sequence[ExecutionPlan], costs: CostModel) -> float:
    """The least step: the busiest node's summed rank work, hand-offs included, over its
    cores (0: no cores set)."""
    if not costs.cores:
        return 0.0
    per_node = costs.network.ranks_per_node if costs.network is not None else max(len(plans), 1)
    waited = waits_one_at_a_time(plans, costs) if costs.handoff else {}
    work: Dict[int, float] = {}
    for plan in plans:
        node = plan.rank // per_node
        own = rank_work(plan, costs) + waited.get(plan.rank, 0) * costs.handoff
        work[node] = work.get(node, 0.0) + own
    return max(work.values(), default=0.0) / costs.cores
