"""config.set_cuda_graphs(True): a rank's step of compute captured once, replayed after.

NOTE: CUDA graphs
A step's kernels are the same every call (a plan is static: shapes, order, micro-batches),
so their launches can be recorded once in a torch.cuda.CUDAGraph and replayed with one
call, taking the host out of the step: what pays at small batches, where launching
hundreds of kernels costs more than running them. graphc captures the rank's whole
compute: every forward and backward of every micro-batch and stage this rank runs, in plan
order (the instructions up to the first one that is not compute; on one rank that is all
of them but the gradient clipping and the optimizer step, which run eagerly after it).

- Call 1 runs uncaptured on the runtime's compute stream (the warm-up torch asks for: cuBLAS
  handles, autograd's streams, the allocator's pools). Call 2 captures on that stream, then
  replays; later calls copy their inputs into the captured (static) input tensors and
  replay. A replay computes what the uncaptured step computes, with the same kernels in the
  same order, so the numbers are equal bit for bit.
- The captured backward writes every parameter's gradient into memory of the graph's
  pool; the step starts from no gradients (NOTE: The graph owns .grad), so a replay's
  gradients are those tensors, given back to the parameters' .grad after it, where the
  optimizer (and clipping, and the user's hooks) read them as usual.
- Returned values are copies of the graph's outputs: the next replay overwrites those.
- The graph reads parameters and buffers at their addresses: if one gets new memory (a
  load_state_dict that assigns, a module moved), the next call captures again.
- Each executable (input shapes, guarded values: NOTE: Guards) captures its own graph.

- Random ops of a one-rank graph draw from the device's generator, as in eager
  (seed_random_ops leaves an op on one rank alone); a CUDA graph registers that generator
  and every replay advances its offset as the uncaptured kernels would.

What cannot be captured is refused when the graph starts (`capture_blockers`), never run
differently: placements on the CPU; plans of several ranks (transfers and collectives,
gloo cannot be captured at all and graphc does not capture NCCL yet); random ops graphc
reseeds per step and micro-batch (on several ranks: NOTE: Replica-equal randomness; a
replay would draw the captured step's numbers again); a GradScaler (its scale is a value of
the step read on the host, and an overflow skips the step); training without an optimizer
(gradients then accumulate over calls into .grad, which the captured backward does not
read). Host reads inside build() (`.item()`, `print(t)`) fail already at trace time, and a
new shape compiles a new executable, so neither reaches a capture. Check mode (graphc
check) runs uncaptured, to compare every forward.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..errors import GraphcError
from ..ops.random_ops import seeded
from ..plan.instructions import COMPUTE, ClipGradNorm, OptimizerStep
from ..plan.plan import ExecutionPlan
from ..plan.program import StageProgram

WARMUP_CALLS = 1   # uncaptured calls before the capture


def capture_blockers(plans: Sequence[ExecutionPlan], stages, programs: Sequence[StageProgram],
                     has_optimizer: bool, grad_scaler) -> List[str]:
    """Why the compiled graph's steps cannot be captured (empty: they can), one line each;
    the same on every rank (NOTE: CUDA graphs)."""
    why = [f"stage {s.stage_id} runs on placement type \"{s.device_type}\": a CUDA graph captures "
           "CUDA kernels. Fix: place the model on \"cuda\" (model.to(\"cuda\"), or set_stage / "
           "to_global with graphc.placement(\"cuda\", ...))" for s in stages if s.device_type != "cuda"]
    if len(plans) > 1:
        why.append(f"the plan spans {len(plans)} ranks: graphc does not capture transfers and "
                   "collectives (gloo cannot be captured, NCCL capture is not built). Fix: CUDA "
                   "graphs on a one-rank graph (several stages on one GPU are fine)")
    other = sorted({type(ins).__name__ for plan in plans for ins in plan.instructions
                    if not isinstance(ins, COMPUTE) and type(ins) not in (OptimizerStep, ClipGradNorm)})
    if other and len(plans) == 1:
        why.append(f"the plan has {', '.join(other)} instructions (ZeRO's gathers and releases, "
                   "gradient all-reduces), which are not captured. Fix: drop enable_zero for a "
                   "one-rank graph")
    why += [f"{_line(node)} draws random numbers, reseeded per step and micro-batch by graphc "
            "(NOTE: Replica-equal randomness); a replay would draw the captured step's numbers "
            "again. Fix: dropout off (p=0 or model.eval()) or no CUDA graphs"
            for prog in programs for node in prog.module.graph.nodes if node.target is seeded]
    if grad_scaler is not None and grad_scaler.enabled:
        why.append("a GradScaler's scale is a value of each step read on the host, and an "
                   "overflow skips the step. Fix: enable_amp with torch.bfloat16 (no loss "
                   "scaling), or no CUDA graphs for fp16")
    if any(plan.training for plan in plans) and not has_optimizer:
        why.append("the graph trains without an optimizer: its gradients accumulate over calls "
                   "into .grad, which a captured backward does not read. Fix: add_optimizer, or "
                   "no CUDA graphs")
    return why


def _line(node) -> str:
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    return f"{trace[-2].strip()}: {trace[-1].strip()}" if len(trace) >= 2 else f"node '{node.name}'"


def compute_prefix(plan: ExecutionPlan) -> int:
    """How many instructions from the start of the plan are compute: what is captured."""
    for i, ins in enumerate(plan.instructions):
        if not isinstance(ins, COMPUTE):
            return i
    return len(plan.instructions)


class StepGraph:
    """The compute of one rank's step, captured on the runtime's stream and replayed.

    Args:
        stream: the runtime's compute stream (capture and replay run on it).
        state: the tensors the captured kernels read at fixed addresses: the stage
            programs' parameters and buffers.
        grad_holders: the tensors whose .grad the captured backward writes (parameters, or
            set_param_dtype's float32 masters).
        executors: the stage executors, whose peak activation counts the replays report as
            the captured step counted them.
    """

    def __init__(self, stream, state: List[torch.Tensor], grad_holders: List[torch.Tensor], executors):
        self.stream, self.state, self.grad_holders, self.executors = stream, state, grad_holders, executors
        self.calls = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.static_inputs: List[torch.Tensor] = []
        self.static_results: Dict[str, List[torch.Tensor]] = {}
        self.grads: List[tuple] = []
        self.addresses: List[int] = []
        self.live: List[tuple] = []
        self.captures = 0

    def run(self, user_inputs: List[torch.Tensor], compute: Callable) -> Dict[str, List[torch.Tensor]]:
        """compute(inputs) -> {result name: per micro-batch values} runs the step's compute;
        uncaptured while warming up, then captured once and replayed."""
        self.calls += 1
        if self.calls <= WARMUP_CALLS:
            return compute(user_inputs)
        if self.graph is None or self._addresses() != self.addresses:
            self._capture(user_inputs, compute)
        for static, x in zip(self.static_inputs, user_inputs):
            static.copy_(x, non_blocking=True)
        self.graph.replay()
        for holder, grad in self.grads:
            holder.grad = grad
        for ex, live, nbytes in self.live:
            ex.max_live, ex.max_live_bytes = live, nbytes
        return {name: [t.clone() for t in values] for name, values in self.static_results.items()}

    def _capture(self, user_inputs: List[torch.Tensor], compute: Callable) -> None:
        device = self.stream.device
        self.graph = None
        self.static_inputs = [torch.empty_like(x, device=device) for x in user_inputs]
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: a DataLoader's pin-memory thread allocating pinned memory while this
            # thread captures would fail under torch's default ("global")
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                self.static_results = compute(self.static_inputs)
        except RuntimeError as exc:   # an op that synchronises or allocates on the host mid-capture
            raise GraphcError(
                f"config.set_cuda_graphs(True): capturing the step failed ({str(exc).splitlines()[0]}). "
                "An op of the step waits for the host or reads a value there (a data-dependent "
                "shape, .item(), a CPU tensor copied in), which a CUDA graph cannot replay. Fix: "
                "drop set_cuda_graphs for this graph, and report the op to graphc if build() has "
                "no such read (NOTE: CUDA graphs).") from exc
        self.graph = graph
        self.grads = [(h, h.grad) for h in self.grad_holders if h.grad is not None]
        self.addresses = self._addresses()
        self.live = [(ex, ex.max_live, ex.max_live_bytes) for ex in self.executors]
        self.captures += 1

    def _addresses(self) -> List[int]:
        return [t.data_ptr() for t in self.state]
