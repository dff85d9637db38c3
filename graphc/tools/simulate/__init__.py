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
    CostModel.collective (a ring or tree over the group's slowest link), plus the drift
    its members' computes since their previous collective cost (CostModel.skew, measured in
    context: NOTE: Collectives in context);
  * with `sends_complete_on_delivery` (gloo), the optimizer step and the end of a step
    wait until every send of the rank has been delivered (the runtime drains its sends);
  * each step begins with the Prologues of the rank's stages, which run outside the plan
    (CostModel.step_start, NOTE: Prologue costs).
With `steps` > 1 the plans run that many times back to back, as a training loop calls
the graph: a rank starts step k+1 as soon as it finished its own step k, while others
may still be in step k, bounded only by the data dependencies (messages on a link are
matched in order across steps). `step_time` is then the steady-state period: the mean
time between the ends of consecutive steps after the first.
If the ranks that compute outnumber `cores`, every compute span is stretched by
ranks / cores: processor sharing with all ranks busy (an upper bound; see docs/inspect.md).
Where the CostModel's `cores` says the ranks of a node share that many cores, the step is
at least their summed work and waits over them (NOTE: Shared cores, graphc/tools/shared_cores.py),
for a world of templates too.
Link contention between different rank pairs is not modelled.

The package, by concern:
  * engine.py: the event engine (links, collectives, the worklist of ranks, the times);
  * memory.py: memory accounting (live micro-batches, peak activation bytes);
  * model_state.py: model-state bytes per rank (parameters, gradients, optimizer state);
  * peak.py: the step's predicted peak memory per rank and the instruction holding it
    (NOTE: Peak memory model), walked by memory_walk.py (one entry per instruction kind);
  * memory_fit.py: will it fit a device, and what to change when it does not;
  * memory_measured.py: the peak measured on a running rank, to check the prediction
    (NOTE: Measured peak memory);
  * folding.py: rank folding (classes of ranks that share one timeline);
  * classes.py: a world of plan templates simulated by its templates (NOTE: Simulated classes);
  * result.py: what a simulation returns (SimResult, RankSummary, SimTimeline);
  * codes.py: the op tuples the engine runs, one per instruction, and their codes.

Example:
    from graphc.tools.cost_model import CostModel
    result = simulate(compiled.plans, CostModel.uniform(num_stages=4))
    print(result.table())
"""
from __future__ import annotations

from typing import Optional, Sequence

from ...plan.plan import ExecutionPlan
from ...plan.templates import PlanWorld
# the timeline vocabulary, shared with the measured traces the runtime writes
from ...runtime.trace import Span, Timeline
from ..cost_model import CostModel
from ..shared_cores import shared_core_floor
from .classes import add_model_state, simulate_classes
from .engine import _Simulation
from .memory import activation_peak, stage_input_bytes
from .model_state import ModelInputs, ModelState, ParamSpec, model_inputs, model_state
from .memory_fit import fit_report
from .peak import MemoryPeak, memory_peak
from .result import RankSummary, SimResult, SimTimeline

__all__ = ["simulate", "SimResult", "RankSummary", "SimTimeline", "Span", "Timeline",
           "activation_peak", "stage_input_bytes", "ModelInputs", "ModelState", "ParamSpec",
           "model_inputs", "model_state", "MemoryPeak", "fit_report", "memory_peak"]


def simulate(plans: Sequence[ExecutionPlan], costs: CostModel, steps: int = 1,
             cores: Optional[int] = None, model: Optional[ModelInputs] = None) -> SimResult:
    """Runs every rank's plan against `costs`; returns the timeline and per-rank summary.

    Args:
        plans: one ExecutionPlan per rank (CompiledGraph.plans), verified or not.
        costs: per-stage compute costs, transport and link costs, activation sizes.
        steps: consecutive steps to run; > 1 reports the steady-state period as step_time.
        cores: CPU cores the ranks share (None: each rank has its own device or core).
        model: each rank's parameters (model_inputs(compiled, optimizer)): the summary then
            reports model-state bytes per rank (NOTE: Model-state bytes); None: it does not.
    Returns:
        SimResult with `step_time`, `bubble_fraction`, `ranks` and `timeline`.
    Raises:
        PlanError if the plans cannot finish (a recv or collective that nothing satisfies).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, found {steps}")
    if isinstance(plans, PlanWorld):   # templates: one timeline per class (NOTE: Simulated classes)
        result = simulate_classes(plans, costs, steps, cores, model)
        if result is not None:   # ranks sharing cores take their summed work here too
            result.step_time = max(result.step_time, shared_core_floor(plans, costs))
            return result
    sim = _Simulation(plans, costs, steps, cores)
    sim.run()
    result = sim.result()
    result.step_time = max(result.step_time, shared_core_floor(plans, costs))   # NOTE: Shared cores
    if model is not None:
        add_model_state(result, {p.rank: p for p in plans}, model, costs)
    return result
