"""A rank's predicted peak memory over a step: what it holds, walked instruction by instruction.

NOTE: Peak memory model
`memory_peak(plan, params, costs)` answers "will it fit": the bytes of tensors a rank holds
at the end of each instruction of its plan, and the highest of them, named by instruction.
It starts from what the rank holds between steps (NOTE: Model-state bytes: parameters, the
gradient buckets kept between steps, the optimizer state) plus the step's batch, and follows
what the runtime allocates and frees (graphc/runtime/executor.py, collectives.py, zero.py;
the walk is memory_walk.py, one entry per instruction kind):
  * FORWARD keeps its micro-batch's activations (CostModel.activation_bytes: the storages
    autograd saves and the stage's outputs, the backward's roots, each once; only the
    stage's inputs for a checkpointed micro-batch);
  * BACKWARD recomputes a checkpointed micro-batch's activations first (a point of its own),
    then frees them; the first backward of a stage in a step creates its parameters' whole
    gradients (later micro-batches accumulate into them);
  * the backward that makes a REDUCE_SCATTER's bucket final launches it (GradSync's hooks):
    the gradients are packed (d parts, padded; stage 1 into its kept bucket) and dropped,
    and this rank's part is received into a buffer; the REDUCE_SCATTER instruction waits,
    the part becoming the shards' gradients (stages 2 and 3). Gathered per unit, one is in
    flight at a time and, without clipping, each unit's shards step and drop it at once;
  * ALL_REDUCE / TIE_ALL_REDUCE: the bucket's gradients are summed in the bucket kept between
    steps, and the parameters' own are dropped;
  * OPTIMIZER_STEP (stages 1, 2) launches every bucket's ALL_GATHER as it steps: the packed d
    parts and this rank's part (and the transport's own copy of the parts: gloo's) are held
    until the ALL_GATHER unpacks; then zero_grad(set_to_none) drops every gradient;
  * stage 3: an ALL_GATHER makes its parameters whole beside the shards' own rows (a copy)
    until RELEASE; a tensor whose rows split evenly is gathered straight into it;
  * RECV: each peer's next `recv_window` receives are posted ahead (buffers held), and a
    received value is held until the compute that reads it; a backward's input gradients
    sent to a peer (SEND_B) stay among the step's values until the step ends.
`between` is the highest over the points a running rank's probe measures too
(NOTE: Measured peak memory); `peak` adds what an instruction holds only inside itself (a gather's
buffer, the gathers launched while the step still holds its gradients, a unit's gather
inside its compute). What neither counts: an op's temporaries, the gradient flowing between
two layers inside a backward. The transport decides ZeRO's buffers (`TRANSPORTS`): NCCL and
a local world pack a bucket; on a gloo group stages 2 and 3 run rank by rank on views (NOTE:
ZeRO rows in place): a reduce-scatter holds the whole gradients and this rank's part until it
is waited for, a gather writes straight into the parameters. tests/tools/test_memory_measured.py
holds the prediction to 5% of the measured peak per rank on eleven layouts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

from ...plan.plan import ExecutionPlan
from ..cost_model import CostModel
from .memory_walk import TRANSPORTS, Walk
from .model_state import ParamSpec


@dataclass(frozen=True)
class MemoryPeak:
    """A rank's predicted memory: held between steps, the step's peak and where it happens."""

    rank: int
    held: int                    # bytes between steps (model state)
    peak: int                    # the step's highest bytes
    at: str                      # the instruction whose end (or inside) holds the peak
    parts: Dict[str, int] = field(default_factory=dict)   # the peak by kind of tensor
    series: Tuple[int, ...] = ()   # bytes held at the end of each instruction, in plan order
    between: int = 0             # the highest where a probe measures (NOTE: Measured peak memory)
    between_at: str = ""

    def fits(self, capacity: int) -> bool:
        return self.peak <= capacity


def memory_peak(plan: ExecutionPlan, params: Sequence[ParamSpec], costs: CostModel,
                transport: Optional[str] = None, recv_window: int = 2, batch: int = 0) -> MemoryPeak:
    """The rank's predicted peak over one steady step (See NOTE: Peak memory model).

    Args:
        plan: the rank's ExecutionPlan.
        params: the rank's ParamSpecs (model_inputs(compiled, optimizer).params[rank]).
        costs: a CostModel with activation_bytes (and input_bytes) per stage.
        transport: what runs the collectives, as TRANSPORTS says: "gloo", "nccl" or "local"
            (a local world); None: the plan's device type's (cpu: gloo, cuda: nccl).
        recv_window: receives posted ahead per peer (config.set_recv_window).
        batch: bytes of the user's inputs the rank reads (ModelInputs.batch).
    """
    if transport is None:
        transport = "nccl" if any(s.device_type == "cuda" for s in plan.stages) else "gloo"
    walk = Walk(plan, params, costs, TRANSPORTS[transport], recv_window, batch)
    walk.run()
    held = walk.held
    parts_at = {k: v for k, v in held.at_parts.items() if v}
    return MemoryPeak(plan.rank, walk.base, held.peak, walk.label(held.at), parts_at, tuple(held.series),
                      held.between, walk.label(held.between_at))
