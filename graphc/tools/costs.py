"""Per-instruction costs for the simulator: unit, measured on this machine, or modelled.

Three ways to get a CostModel:
  * `CostModel.uniform(p)`: forward 1, backward 2, free communication (schedule charts,
    bubble arithmetic);
  * `measure_costs(compiled)`: runs each stage's program forward and backward on random
    inputs of the planned shapes, here, with the runtime's own StageExecutor;
  * `device_costs(compiled, "h100")`: FLOPs (counted on fake tensors) over a preset's
    peak rate, bytes over its memory bandwidth, links and collectives from the preset
    (NVLink inside a node, the network between nodes: graphc/tools/network.py).

A split backward costs half a backward for each of its halves (BackwardInput, BackwardWeight)
unless they were measured; DualPipeV's OverlapFB costs its forward plus its backward (on a
CPU the two run one after the other).
"""
from __future__ import annotations

import copy
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Dict, List, Optional

import torch

from ..errors import GraphcError
from ..plan.instructions import AllReduce, Instruction
from .cost_model import CostModel
from .network import DEVICES, Network  # noqa: F401 (DEVICES: API)
from .prologue_costs import prologue_costs, prologue_ops_and_bytes
from .stage_inputs import stage_inputs
from .ring_overlap import ring_blocks
from .transport_costs import measure_transport


# gloo over loopback on one machine: the defaults measured costs use for links
CPU_LINK_LATENCY_S = 100e-6
CPU_LINK_BANDWIDTH = 2e9


def _for_ranks(costs: CostModel, compiled) -> CostModel:
    return replace(costs, stage_of_rank={r: s.stage_id for s in compiled.stages for r in s.ranks})


# -- measured ------------------------------------------------------------------------------
def measure_costs(compiled, optimizer=None, repeats: int = 5, threads: Optional[int] = 1,
                  latency: float = CPU_LINK_LATENCY_S, bandwidth: float = CPU_LINK_BANDWIDTH,
                  overhead: float = 0.0, transport: Optional[str] = None,
                  concurrent: bool = False) -> CostModel:
    """Times each stage here, replaying its rank's compute instructions of one step in order.

    Each stage runs on a copy of its module (the user's parameters and gradients are not
    touched): the forwards and backwards of every micro-batch in the plan's order, then
    the optimizer step over the copy's real-shaped parameters and gradients followed by
    zero_grad(set_to_none=True), as the runtime does, so allocation of fresh gradients and
    the cache state of a real step are part of the times.

    Args:
        compiled: a CompiledGraph (graph.compiled, or from graphc.compiler.compile).
        optimizer: the graph's optimizer; a copy of its type (same defaults) steps the
            stage copy's parameters (None: optimizer_step is free).
        repeats: timed steps per stage after one warm-up step; the median is used (of the
            mean forward / backward per micro-batch, and of the optimizer step).
        threads: torch threads while timing (torchrun sets OMP_NUM_THREADS=1 for several
            processes per machine, so 1 matches a multi-rank CPU run); None keeps the current.
        latency, bandwidth: link model of collectives, and of sends when `transport` is None
            (defaults: gloo loopback). The stage's collectives move nothing while it is
            timed (NOTE: Shapes only): the plan's Collective instructions are modelled.
        transport: "shm", "gloo" or "auto" (what graphc.runtime.comm picks for cpu ranks on
            one host, GRAPHC_P2P honoured): measure that transport's per-send and per-recv
            CPU cost, latency and a waiting receiver's polling delay with two spawned
            processes (measure_transport), instead of the link defaults.
        concurrent: replay every rank's stage at once, one forked process per rank, so that
            the times include what ranks sharing this host's cores and memory cost each
            other (NOTE: Concurrent replay in graphc/tools/concurrent_replay.py); False:
            each stage alone, one after the other.
    Returns:
        A CostModel whose parameters' gradients are left as they were.
    """
    saved_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        if concurrent:
            from .concurrent_replay import replay_concurrently
            times = replay_concurrently(compiled, optimizer, repeats, threads or saved_threads,
                                        _replay_stage)
        else:
            times = _replay_one_by_one(compiled, optimizer, repeats)
    finally:
        torch.set_num_threads(saved_threads)
    costs = CostModel({s: t.forward for s, t in times.items()},
                      {s: t.backward for s, t in times.items()},
                      {s: t.optimizer for s, t in times.items()},
                      {s: t.activation for s, t in times.items()}, latency, bandwidth,
                      overhead=overhead, collective_link=(bandwidth, latency),
                      source=f"measured on this machine, {threads or saved_threads} thread(s)"
                             + (", every rank's stage at once" if concurrent else ""),
                      backward_input={s: t.backward_input for s, t in times.items()
                                      if t.backward_input is not None},
                      backward_weight={s: t.backward_weight for s, t in times.items()
                                       if t.backward_weight is not None},
                      input_bytes={p.stage: sum(t.nbytes for t in stage_inputs(p, compiled).values()
                                                if isinstance(t, torch.Tensor))
                                   for p in compiled.programs},
                      prologue=prologue_costs(compiled, {s: t.prologue for s, t in times.items()}))
    if transport is not None:
        sizes = sorted({t.nbytes for p in compiled.plans for ins in p.instructions
                        if ins.runs == "send" for t in ins.tensors})
        buckets = [sum(t.nbytes for t in ins.tensors) for p in compiled.plans for ins in p.instructions
                   if isinstance(ins, AllReduce)]   # the family: buckets, ties, shards
        tc = measure_transport(transport, max(sizes) if sizes else 4, threads=threads or 1,
                               reduce_bytes=max(buckets, default=1 << 20))
        costs = tc.apply(costs)
    return _for_ranks(costs, compiled)


def _replay_one_by_one(compiled, optimizer, repeats: int) -> Dict[int, "_StageTimes"]:
    times = {}
    start = time.perf_counter()
    for i, prog in enumerate(compiled.programs):
        times[prog.stage] = _replay_stage(prog, compiled, optimizer, repeats)
        _progress("measured", i + 1, len(compiled.programs), time.perf_counter() - start)
    return times


def _progress(what: str, done: int, total: int, elapsed: float) -> None:
    """A line per stage with an ETA while costs are measured, at a terminal only."""
    if not sys.stderr.isatty() or total < 2:
        return
    eta = elapsed / done * (total - done)
    from ..log import get_logger
    get_logger("plan").info("%s stage %d/%d (%.1f s, about %.1f s left)", what, done, total, elapsed, eta)


@dataclass
class _StageTimes:
    """One stage's replayed step: seconds per micro-batch (medians over steps), bytes."""

    forward: float = 0.0
    backward: float = 0.0           # a whole backward, or I + W where the plan splits it
    backward_input: Optional[float] = None
    backward_weight: Optional[float] = None
    optimizer: float = 0.0
    activation: int = 0
    prologue: float = 0.0           # the stage's Prologue over every micro-batch (NOTE: Prologue costs)


def _replay_stage(prog, compiled, optimizer, repeats: int) -> _StageTimes:
    """Times one stage's compute instructions of one step in plan order (see measure_costs).

    The stage's collectives move nothing (NOTE: Shapes only): plan mode has no process group,
    and the plan's Collective instructions are what the simulator charges for communication.
    """
    from ..ops.conversions import shapes_only
    rank = compiled.stages[prog.stage].ranks[0]
    with shapes_only(rank):
        return _replay_stage_here(prog, compiled, optimizer, repeats, rank)


def _replay_stage_here(prog, compiled, optimizer, repeats: int, rank: int) -> _StageTimes:
    from ..runtime.executor import StageExecutor
    module = copy.deepcopy(prog.module)
    _localize(module)
    for p in module.parameters():
        p.grad = None
    ex = StageExecutor(replace(prog, module=module), compiled.training,
                       prog.loss_weight(compiled.num_microbatches))
    opt = _rebuild_optimizer(module, optimizer) if compiled.training else None
    plan = compiled.plan_for(rank) if hasattr(compiled, "plan_for") else compiled.plans[rank]
    order = [part for ins in plan.instructions for part in _parts(ins)
             if getattr(part, "stage", prog.stage) == prog.stage]
    inputs = stage_inputs(prog, compiled)
    per_step: Dict[str, List[float]] = {k: [] for k in "FBIWOP"}
    replay = _Replay(ex, opt, prog, inputs)
    for step in range(repeats + 1):
        replay.start_step()
        replay.prologue(compiled.num_microbatches)
        for ins in order:
            replay.run(ins)
        if step:    # the first step warms caches, allocators and optimizer state
            for k, v in replay.times.items():
                per_step[k].append(statistics.mean(v) if v else 0.0)
    act = replay.activation
    med = {k: statistics.median(v) for k, v in per_step.items()}
    split = any(ins.runs == "backward_input" for ins in order)
    return _StageTimes(med["F"], med["B"] if not split else med["I"] + med["W"],
                       med["I"] if split else None, med["W"] if split else None, med["O"], act,
                       med["P"])


def _parts(ins: Instruction) -> tuple:
    """The compute (and optimizer step) an instruction runs: an OverlapFB's two halves."""
    return ins.parts if ins.runs in _REPLAYED or ins.runs == "overlap" else ()


class _Replay:
    """One stage's compute instructions run and timed by their run entry (`ins.runs`,
    plan/instructions.py), as the runtime dispatches them: `_<runs>` here, its time under
    the letter the CostModel keeps (F, B, I, W, O)."""

    def __init__(self, ex, opt, prog, inputs):
        self.ex, self.opt, self.prog, self.inputs = ex, opt, prog, inputs
        self.activation = 0
        self.start_step()

    def start_step(self) -> None:
        self.times: Dict[str, List[float]] = {k: [] for k in "FBIWOP"}
        self.outs: Dict[int, dict] = {}

    def prologue(self, m: int) -> None:
        """The stage's Prologue over m micro-batches, as the runtime runs it before the plan
        (its all-reduces move nothing here: NOTE: Prologue costs charges them)."""
        if self.prog.prologue is None:
            return
        t0 = time.perf_counter()
        self.ex.prologue([dict(self.inputs) for _ in range(m)])
        self.times["P"].append(time.perf_counter() - t0)

    def run(self, ins: Instruction) -> None:
        letter = _REPLAYED[ins.runs]
        if letter == "O" and self.opt is None:
            return
        seconds = getattr(self, f"_{ins.runs}")(ins)
        self.times[letter].append(seconds)

    def _forward(self, ins) -> float:
        t0 = time.perf_counter()
        outs = self.outs[ins.microbatch] = self.ex.forward(ins.microbatch, dict(self.inputs))
        seconds = time.perf_counter() - t0
        saved = self.ex.saved.get(ins.microbatch)  # the executor counts what autograd saves
        self.activation = (saved.nbytes if saved is not None else 0) + sum(
            t.nbytes for t in outs.values() if isinstance(t, torch.Tensor))
        return seconds

    def _backward(self, ins) -> float:
        return self._timed_backward(self.ex.backward, ins)

    def _backward_input(self, ins) -> float:
        return self._timed_backward(self.ex.backward_input, ins)

    def _timed_backward(self, run, ins) -> float:
        grads = _output_grads(self.prog, self.outs.pop(ins.microbatch))   # what recvs deliver
        t0 = time.perf_counter()
        run(ins.microbatch, grads)
        return time.perf_counter() - t0

    def _backward_weight(self, ins) -> float:
        t0 = time.perf_counter()
        self.ex.backward_weight(ins.microbatch)
        return time.perf_counter() - t0

    def _optimizer_step(self, ins) -> float:
        t0 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


# the run entries a stage's replay times, and the letter each one's seconds are kept under
_REPLAYED = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W",
             "optimizer_step": "O"}


def _rebuild_optimizer(module, graph_opt):
    params = [p for p in module.parameters() if p.requires_grad]
    if graph_opt is None or not params:
        return None
    try:
        return type(graph_opt)(params, **copy.deepcopy(graph_opt.defaults))
    except Exception:   # an optimizer that cannot be rebuilt from its defaults: not timed
        return None




def _output_grads(prog, outs) -> List:
    sent = {t.name for specs in prog.send_to.values() for t in prog.grad_specs(specs)}
    return [(name, torch.randn_like(outs[name])) for name in sorted(sent)
            if outs[name].requires_grad]


class _SavedBytes:
    """Counts the bytes autograd saves for backward: a stage's activation memory.

    Each saved storage counts once and whole (views of one tensor, as a split's q, k and v,
    share it), as a running rank holds it (NOTE: Measured peak memory), and so do the
    outputs (`add`: the backward's roots). Parameters saved for backward (a linear's weight,
    or a view of it) are weights, not activations, and are skipped, as is the batch.
    """

    def __init__(self, module, not_saved=()):
        # a storage by its StorageImpl (fake tensors have no address); `not_saved`: more
        # tensors that are no activations (fake parameters, the batch)
        self.seen = {p.untyped_storage()._cdata for p in [*module.parameters(), *not_saved]}

    def add(self, *tensors) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            if storage._cdata not in self.seen:
                self.seen.add(storage._cdata)
                self.kept.append(storage)   # alive, so no address is reused while counting
                self.nbytes += storage.nbytes()

    def __enter__(self):
        self.nbytes = 0
        self.kept = []

        def pack(t):
            self.add(t)
            return t

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


# -- modelled from FLOPs and bytes --------------------------------------------------------
def device_costs(compiled, device: str = "h100", **overrides) -> CostModel:
    """Costs on a named accelerator from counted FLOPs and bytes (no accelerator needed).

    forward = max(FLOPs / (peak * efficiency), bytes / HBM bandwidth), where bytes are the
    stage's parameters plus its saved activations and the peak is the preset's bf16/fp16
    rate for ops on bf16/fp16 operands (autocast's matmuls under enable_amp) and its
    float32 rate for the others (graphc/tools/flops.py), plus the preset's host time per op
    dispatched (CPU ranks; 0 on accelerators); backward is twice forward (input and weight
    gradients). A CPU preset's host costs per instruction, collective and transfer and the
    cores its ranks share go to the CostModel too (NOTE: Shared cores). Transfers and collectives inside a node of `gpus_per_node` ranks use
    NVLink, between nodes the network (graphc/tools/network.py has the numbers and their
    sources). `overrides` replace preset fields, e.g. tflops=400, link_gbps=50, net_gbps=25.
    """
    if device not in DEVICES:
        raise GraphcError(f"unknown device preset {device!r}; choose one of {sorted(DEVICES)} "
                          "or pass tflops=..., hbm_gbps=..., link_gbps=..., latency_us=..., net_gbps=...")
    dev = replace(DEVICES[device], **overrides)
    fwd, bwd, act = {}, {}, {}
    for prog in compiled.programs:
        flops, saved = _count_stage(prog, compiled)
        params = sum(p.numel() * p.element_size() for p in prog.module.parameters())
        t = max(flops.seconds(dev.tflops * 1e12 * dev.efficiency, dev.fp32_tflops * 1e12 * dev.efficiency),
                (params + saved) / (dev.hbm_gbps * 1e9)) + flops.ops * dev.op_us * 1e-6
        fwd[prog.stage], bwd[prog.stage], act[prog.stage] = t, 2 * t, saved
    host = dev.op_us or dev.instruction_us or dev.collective_us or dev.p2p_us or dev.cores_per_node
    # a Prologue's ops are a handful of small ones: their host time, not FLOPs (NOTE: Prologue costs)
    prologue = {p.stage: prologue_ops_and_bytes(p, compiled)[0] * dev.op_us * 1e-6
                for p in compiled.programs if p.prologue is not None}
    costs = CostModel(fwd, bwd, {}, act, dev.latency_us * 1e-6, dev.link_gbps * 1e9,
                      network=Network.of(dev), overhead=dev.instruction_us * 1e-6,
                      send_overhead=dev.p2p_us * 1e-6, recv_overhead=dev.p2p_us * 1e-6,
                      collective_overhead=dev.collective_us * 1e-6, cores=dev.cores_per_node or None,
                      handoff=dev.handoff_us * 1e-6, prologue=prologue_costs(compiled, prologue),
                      source=f"modelled for {dev.name}: {dev.tflops} TFLOP/s bf16, "
                             f"{dev.fp32_tflops} fp32, x {dev.efficiency}, "
                             f"HBM {dev.hbm_gbps} GB/s, NVLink {dev.link_gbps} GB/s in nodes of "
                             f"{dev.gpus_per_node}, network {dev.net_gbps} GB/s between them"
                             + (f"; host {dev.op_us} us per op, {dev.instruction_us} per instruction, "
                                f"{dev.collective_us} per collective, {dev.p2p_us} per transfer, "
                                f"{dev.handoff_us} per wait, {dev.cores_per_node} cores a node"
                                if host else ""))
    # each ring step's transfer beside its block's compute (NOTE: Ring overlap)
    costs.ring_blocks = ring_blocks(compiled, dev.tflops * 1e12 * dev.efficiency, dev.fp32_tflops * 1e12 * dev.efficiency)
    return _for_ranks(costs, compiled)


def _local_shape(module, name: str, t: torch.Tensor) -> tuple:
    """The shape of this rank's component of a parameter or buffer (plan mode holds whole ones)."""
    from ..meta import META_SBP
    from ..sbp.layout import local_shape
    sig = next((n.meta.get(META_SBP) for n in module.graph.nodes
                if n.op == "get_attr" and n.target == name and n.meta.get(META_SBP)), None)
    return tuple(t.shape) if sig is None else tuple(local_shape(t.shape, sig.out, sig.mesh))


def _local_fake(mode, module, name: str, t: torch.Tensor) -> torch.Tensor:
    """A fake of this rank's component of a parameter or buffer."""
    shape = _local_shape(module, name, t)
    if shape == tuple(t.shape) and t.device.type == "cpu":   # a GPU's or meta: a CPU fake, as the trace's
        return mode.from_tensor(t)
    with mode:
        return torch.empty(shape, dtype=t.dtype, requires_grad=t.requires_grad)


def _localize(module) -> None:
    """Cuts a stage copy's whole parameters and buffers to one rank's component, in place:
    a rank computes on its shards (values do not matter for timing, shapes do)."""
    cut: Dict[int, torch.Tensor] = {}    # a tied tensor is cut once, its names share the piece
    named = list(module.named_parameters(remove_duplicate=False)) + \
        list(module.named_buffers(remove_duplicate=False))
    for name, t in named:
        if id(t) not in cut:
            shape = _local_shape(module, name, t)
            if shape == tuple(t.shape):
                continue
            piece = t.detach()[tuple(slice(0, n) for n in shape)].clone()
            cut[id(t)] = (torch.nn.Parameter(piece, requires_grad=t.requires_grad)
                          if isinstance(t, torch.nn.Parameter) else piece)
        owner, _, attr = name.rpartition(".")
        holder = module.get_submodule(owner)
        if isinstance(t, torch.nn.Parameter):
            setattr(holder, attr, cut[id(t)])
        else:
            holder.register_buffer(attr, cut[id(t)],
                                   persistent=attr not in holder._non_persistent_buffers_set)


def _count_stage(prog, compiled):
    """Forward FLOPs (by rate: a Flops) and saved-activation bytes of one micro-batch, on
    fake tensors."""
    from ..ops.conversions import shapes_only
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call
    from .flops import CountFlops
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    params = {k: _local_fake(mode, prog.module, k, v) for k, v in
              list(prog.module.named_parameters()) + list(prog.module.named_buffers())}
    with mode:
        inputs = stage_inputs(prog, compiled)
        args = [inputs[n].requires_grad_(inputs[n].is_floating_point() and compiled.training)
                for n in prog.inputs]
        counter = CountFlops()
        # the user's inputs are the batch, held whole for the step, not a micro-batch's
        batch = [inputs[n] for n in prog.user_inputs]
        with counter, _SavedBytes(prog.module, [*params.values(), *batch]) as saved, \
                torch.set_grad_enabled(compiled.training), \
                shapes_only(compiled.stages[prog.stage].ranks[0]):
            outs = functional_call(prog.module, params, tuple(args))
            if compiled.training:     # the outputs are the backward's roots, held until it runs
                saved.add(*[t for t in outs if isinstance(t, torch.Tensor)])
    return counter.flops, saved.nbytes

