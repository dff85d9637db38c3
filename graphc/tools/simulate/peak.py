"""A rank's predicted peak memory over a step: what it holds, walked instruction by instruction.

NOTE: Peak memory model
`memory_peak(plan, params, costs)` answers "will it fit": the bytes of tensors a rank holds
at the end of each instruction of its plan, and the highest of them, named by instruction.
It starts from what the rank holds between steps (NOTE: Model-state bytes: parameters, the
gradient buffers kept between steps, the optimizer state) and follows what the runtime
allocates and frees (graphc/runtime/executor.py, grad_hooks.py, zero.py):
  * FORWARD keeps its micro-batch's saved activations (CostModel.activation_bytes; only
    the stage's inputs for a checkpointed micro-batch);
  * BACKWARD recomputes a checkpointed micro-batch's activations first, then frees them; the
    first backward of a stage in a step creates its parameters' whole gradients (later
    micro-batches accumulate into them); a trained parameter no collective names also keeps
    a gradient buffer of its size between steps (NOTE: Model-state bytes);
  * ALL_REDUCE / TIE_ALL_REDUCE: the bucket's gradients are summed in the bucket kept between
    steps, and the parameters' own gradients are dropped;
  * REDUCE_SCATTER packs the bucket (every rank's part, padded) and receives this rank's
    summed part; the whole gradients are dropped once packed; the part stays as the shards'
    gradients (stages 2 and 3) until the optimizer step, or is written into the kept packed
    bucket (stage 1);
  * ALL_GATHER: a gather holds its packed buffer (d parts, padded) and this rank's part from
    its launch until it unpacks; at stage 3 the unpacked parameters stay whole until RELEASE;
    at stages 1 and 2 the optimizer step launches every bucket's gather as it steps, so all
    of them are held at the end of OPTIMIZER_STEP;
  * OPTIMIZER_STEP drops the shards' gradients (stages 2 and 3).
Within an instruction the model takes the larger of its start and end (a backward frees a
layer's activations as it creates that layer's gradients), so transients smaller than one
layer's tensors (an op's temporary, the gradient flowing between two layers) are not
counted; tests/tools/test_memory_model.py compares the prediction with the peak measured on
real gloo ranks (the profiler's allocator events) and states the tolerance.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Sequence, Tuple

from ...plan.plan import ExecutionPlan
from ..cost_model import CostModel
from .memory_walk import Walk
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
                gather_copies: int = 1, recv_window: int = 2, batch: int = 0) -> MemoryPeak:
    """The rank's predicted peak over one steady step (See NOTE: Peak memory model).

    Args:
        plan: the rank's ExecutionPlan.
        params: the rank's ParamSpecs (model_inputs(compiled, optimizer).params[rank]).
        costs: a CostModel with activation_bytes (and input_bytes) per stage.
        gather_copies: extra copies of a gathered bucket the transport makes (gloo's
            all-gather into one tensor copies the gathered parts once: 1; NCCL and the local
            world: 0).
        recv_window: receives posted ahead per peer (config.set_recv_window).
        batch: bytes of the user's inputs the rank reads (ModelInputs.batch).
    """
    walk = Walk(plan, params, costs, gather_copies, recv_window, batch)
    walk.run()
    held = walk.held
    parts_at = {k: v for k, v in held.at_parts.items() if v}
    return MemoryPeak(plan.rank, walk.base, held.peak, held.at, parts_at, tuple(held.series),
                      held.between, held.between_at)
