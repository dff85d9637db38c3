"""The actor runtime.

One compute actor walks the plan's compute instructions in order; one receive actor and
one send actor per peer move tensors (runtime/peer_actors.py). Receive actors run ahead of compute: each keeps up
to `window` receives posted (its buffers), so a transfer overlaps the compute before the
one that needs it. Send actors post a send as soon as compute has produced its tensors
and hold them until the transfer completes. Compute fires when its received inputs have
arrived. The plan verifier has proven the send/recv pairing deadlock-free, so waiting
on a receive always ends (or the process group's timeout fires).

Under torch.profiler every instruction runs inside a record_function range named like its
listing (`1F3`, `0SEND_F3 to=1 stage=1`, `ALL_REDUCE bucket 2`), so a profile shows the
plan's steps with the kernels under them. Without a profiler the ranges are skipped: a
record_function costs ~10 us on a CPU even when nothing records it.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import nullcontext
from typing import Dict, List, Optional, Tuple

import torch
from torch.profiler import record_function

from ..errors import RankFailedError
from ..log import warn_user
from ..meta import META_SBP
from ..placement import Broadcast
from ..plan.instructions import (ACT, INSIDE_COMPUTE, INSTRUCTIONS, PRE, AllGather, AllReduce,
                                 Backward, BackwardInput, BackwardWeight, ClipGradNorm, Forward, OptimizerStep,
                                 OutputAllReduce, OverlapFB, PrePass, Recv, ReleaseParams, Send)
from ..plan.plan import ExecutionPlan, checkpointed_microbatches
from ..plan.program import StageProgram
from .collectives import GradSync, OutputSums
from .compiled_stages import CompileRecord, take_compile_seconds
from .compiled_stages import compile_stages as compile_stages_of
from .cuda_graphs import StepGraph, compute_prefix
from .device import place_programs
from .executor import StageExecutor
from .grad_hooks import UserGradHooks
from .optimizer_runner import OptimizerRunner, local_parameters
from .peer_actors import RecvActor, SendActor, _assemble
from .pre_pass import PrePasses
from .step_values import StepStats, StepValues
from .stopped_ranks import explain_stopped_peers
from .zero import ZeroShards, prefetches, released_in, whole_parameters
from .zero_sync import ZeroGradSync
from .zero_units import UnitGatherer


def range_names(instructions) -> List[Optional[str]]:
    """Each instruction's torch.profiler range: its listing without the tensor list, data-parallel
    all-reduces numbered by bucket. None for a Collective, which runs inside its forward or
    backward (and shows there as the process group's own range)."""
    names, bucket = [], 0
    for ins in instructions:
        if ins.runs == INSIDE_COMPUTE:   # a conversion or a unit event: inside its compute
            names.append(None)
        elif type(ins) is AllReduce:
            names.append(f"ALL_REDUCE bucket {bucket} ranks={list(ins.ranks)}")
            bucket += 1
        else:
            names.append(str(ins).split(" [", 1)[0])
    return names


_NO_RANGE = nullcontext()


class Runtime(OptimizerRunner):
    """Runs one rank's plan, one call of `step` per training (or inference) step.

    The rank holds one executor per stage (model chunk) its plan computes. A value between
    two of its chunks is handed over in memory when its producer computes it (the plan
    lists no transfer for it, see lower_plan).
    """

    def __init__(self, plan: ExecutionPlan, programs: Dict[int, StageProgram], p2p, device,
                 optimizer=None, lr_scheduler=None, window: int = 2, trace: bool = False,
                 grad_scaler=None, masters=None, cuda_graphs: bool = False, memory_stats: bool = False,
                 compile_stages: bool = False):
        self.plan, self.p2p, self.device = plan, p2p, device
        self.masters = masters   # set_param_dtype's float32 masters (NOTE: Master parameters)
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self.grad_scaler = grad_scaler if grad_scaler is not None and grad_scaler.enabled else None
        self.found_inf: Optional[bool] = None  # this step's overflow, once gradients are unscaled
        self.window, self.trace = window, trace
        self.calls = 0   # steps begun: a failure names the call a stopped peer did not make
        # check mode (NOTE: Checked steps, graphc/checking/every_step.py): each Forward's outputs this step, as
        # (instruction, stage, micro-batch, {name: value}); None: not kept
        self.captured: Optional[list] = None
        m = plan.num_microbatches
        ckpt = checkpointed_microbatches(plan.checkpointing, m)
        place_programs(programs.values(), device)   # constants traced on the CPU (NOTE: CUDA placement)
        self.executors: Dict[int, StageExecutor] = {
            s: StageExecutor(prog, plan.training, prog.loss_weight(m), ckpt, memory_stats)
            for s, prog in programs.items()}
        self.pre_passes = PrePasses(self.executors, m)   # PrePass (NOTE: Whole-batch sums)
        self.memory_stats = memory_stats   # config.set_memory_stats: StepStats.max_live_bytes
        # a measurement around each instruction (NOTE: Measured peak memory): an object with
        # before(i, step) and after(i, step), or None
        self.probe = None
        self.compiled: Dict[int, CompileRecord] = {}   # NOTE: Compiled stages, filled below
        # ZeRO's shards (See NOTE: ZeRO in zero.py): the optimizer holds them from here on
        self.zero = (ZeroShards.from_plan(plan, list(programs.values()), optimizer, masters)
                     if plan.training else None)
        self.grad_sync = (GradSync.from_plan(plan, list(programs.values()), masters) if self.zero is None  # None without synced grads
                          else ZeroGradSync.for_shards(plan, list(programs.values()), self.zero, masters))
        self.output_sums = OutputSums()   # build()'s partial_sum results, once a step
        # the user's post-accumulate-grad hooks, called once a step (NOTE: Post-accumulate-grad hooks)
        self.grad_hooks = UserGradHooks(local_parameters(programs.values()), self._not_whole(programs))
        # whose .grad a step starts without (NOTE: The graph owns .grad), each once
        self.owned = list({id(p): p for p in local_parameters(programs.values()).values()}.values())
        # NOTE: Gradients freed at the next step. On a CPU, the gradients optimizer.zero_grad()
        # lets go of after a step are kept until the next step starts, where an eager loop's
        # zero_grad() frees them: freed at the end of the step, they (~4 bytes a parameter, 12.6
        # MB at the GPT example's width 256) were the top of the heap, which glibc's free() gives
        # back to the kernel (its trim threshold), and the next step touched the same memory
        # again as fresh pages: 4,300 page faults and 7.8 ms of system time a step, 5% of the
        # step (benchmarks/gpt.py; the same process's eager steps: none). .grad is None between
        # calls as before; only the memory is held. On a GPU the caching allocator keeps freed
        # blocks anyway, and holding them would only raise the memory between calls.
        self.kept_grads: List[Optional[torch.Tensor]] = []
        # ZeRO stage 3's gathers, each launched before the compute ahead of it (NOTE: ZeRO stage 3)
        self.warned_whole = False
        self.not_gathered = self._gathered_elsewhere()
        self.prefetch = prefetches(plan.instructions) if self.zero is not None and self.zero.stage == 3 else {}
        if compile_stages:
            self.compiled = compile_stages_of(self.executors, plan)
        # ... or, gathered per unit, the gathers and releases inside its computes (NOTE: ZeRO units)
        units = UnitGatherer.from_plan(plan, self.zero)   # by stage: one per chunk with units
        for s, ex in self.executors.items():
            ex.units = units.get(s)
        for gatherer in units.values():
            gatherer.reached = self.grad_sync.finish_flying
        if units:
            self.grad_sync.scattered = lambda ins: [g.scattered(ins) for g in units.values()]
            self.grad_sync.in_flight = 1
        if units and self._steps_per_unit():
            self.grad_sync.step_now = lambda ins: self.zero.step_reduced(self.optimizer, ins)
        # each peer's receives in plan order, and the peers sent to: fixed by the plan
        self.recv_queues: Dict[int, List[Recv]] = defaultdict(list)
        for ins in plan.instructions:
            if isinstance(ins, Recv):
                self.recv_queues[ins.peer].append(ins)
        self.send_peers = sorted({ins.peer for ins in plan.instructions if isinstance(ins, Send)})
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # config.set_cuda_graphs: the step's compute captured and replayed (NOTE: CUDA graphs;
        # Executable.start refused what cannot be captured)
        self.step_graph = self._step_graph() if cuda_graphs and self.stream is not None else None
        self.range_names = range_names(plan.instructions)
        # each instruction kind's run entry (its class's `runs`): a kind without one fails here
        self.run_entries = {cls.runs: getattr(self, f"_run_{cls.runs}") for cls in INSTRUCTIONS}
        # values between this rank's own chunks: (from stage, to stage, names)
        self.local_acts = {s: [(b, [t.name for t in specs]) for b, specs in sorted(prog.send_to.items())
                               if b in programs] for s, prog in programs.items()}
        self.local_grads = {s: [(a, [t.name for t in prog.grad_specs(specs)])
                                for a, specs in sorted(prog.recv_from.items()) if a in programs]
                            for s, prog in programs.items()}

    def _step_graph(self) -> StepGraph:
        programs = [ex.program for ex in self.executors.values()]
        state = {id(t): t for prog in programs for t in list(prog.module.parameters()) + list(prog.module.buffers())}
        # every tensor whose .grad the backward may write: parameters, and set_param_dtype's masters
        holders = list(local_parameters(programs).values()) + list(self._grad_holders().values()) \
            if self.plan.training else []
        return StepGraph(self.stream, list(state.values()), list({id(h): h for h in holders}.values()),
                         list(self.executors.values()))

    @property
    def executor(self) -> Optional[StageExecutor]:
        """The executor of this rank's first stage (None on a rank without a stage)."""
        return next(iter(self.executors.values()), None)

    def set_draw(self, base_seed: int, step: int) -> None:
        for ex in self.executors.values():
            ex.draw = (base_seed, step)

    def step(self, user_inputs: List[torch.Tensor]) -> Tuple[Dict[str, List[torch.Tensor]], StepStats]:
        """Runs the plan once. Returns each build() result computed here, per micro-batch."""
        self.calls += 1
        try:
            held = released_in(self.not_gathered)
            if held:   # stage-3 parameters this plan does not gather (NOTE: ZeRO stage 3)
                self._warn_whole(len(held))
                with whole_parameters(held):
                    return self._on_stream(user_inputs)
            return self._on_stream(user_inputs)
        except (RuntimeError, RankFailedError) as exc:   # a peer that ran out of data, named
            stopped = explain_stopped_peers(exc, self.plan.rank, self.plan.world_size, self.calls)
            if stopped is None:
                raise
            raise stopped from exc

    def _on_stream(self, user_inputs):
        """The step on the rank's compute stream, ordered after everything the caller's stream
        has queued: its inputs and parameters written there (a batch copied in, a
        load_state_dict), and its reads of the last step's outputs, whose memory this step's
        allocations on the compute stream may reuse once the caller dropped them. The caller's
        stream then waits for the step, so the outputs are ready to read there."""
        if self.stream is None:
            return self._run(user_inputs)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = self._run(user_inputs)
        torch.cuda.current_stream().wait_stream(self.stream)
        return out

    def _steps_per_unit(self) -> bool:
        """Whether each unit's shards may step as soon as their gradient is reduced: nothing
        reads the whole step's gradients first (clipping's norm, loss scaling's inf check)
        (NOTE: ZeRO units)."""
        return (self.optimizer is not None and self.grad_scaler is None
                and not any(isinstance(ins, ClipGradNorm) for ins in self.plan.instructions))

    def _warn_whole(self, n: int) -> None:
        if not self.warned_whole:
            self.warned_whole = True
            warn_user(f"{n} parameter(s) sharded by ZeRO stage 3 (by another graph, or by this "
                      "graph while they trained) are read by this plan, which does not gather them: "
                      "each call gathers them whole first and frees them after (slow path). Fix: "
                      "enable_zero(True, stage=3) in the other graph as well; a layer frozen after "
                      "the first call is gathered so until it trains again.")

    def _gathered_elsewhere(self) -> List[torch.nn.Parameter]:
        """This rank's parameters that its plan's own ZeRO gathers do not cover."""
        params = local_parameters([ex.program for ex in self.executors.values()])
        mine = {id(s.param) for s in self.zero.by_name.values()} \
            if self.zero is not None and self.zero.stage == 3 else set()   # by object: a tie has two names
        return list({id(p): p for p in params.values() if id(p) not in mine}.values())

    def _not_whole(self, programs: Dict[int, StageProgram]) -> Dict[str, str]:
        """This rank's parameters whose .grad is not their whole gradient, with why."""
        out: Dict[str, str] = {}
        for prog in programs.values():
            for node in prog.module.graph.nodes:
                sig = node.meta.get(META_SBP)
                split = sig is not None and not all(isinstance(s, Broadcast) for s in sig.out)
                if node.op == "get_attr" and split:
                    out[str(node.target)] = "it is split over the ranks of its stage (tensor parallel)"
        if self.zero is not None:
            out.update({n: "ZeRO shards its gradient over the data-parallel ranks" for n in self.zero.by_name})
        if self.masters is not None:
            out.update({n: "set_param_dtype keeps its gradient in a float32 master, not in .grad"
                        for n in local_parameters(programs.values())})
        return out

    def _actors(self):
        """Fresh actors for one step (their tags and buffers are per step)."""
        recv_actors = {p: RecvActor(p, q, self.p2p, self.device, self.window)
                       for p, q in self.recv_queues.items()}
        send_actors = {p: SendActor(p, self.p2p) for p in self.send_peers}
        return recv_actors, send_actors

    def _microbatches(self, user_inputs: List[torch.Tensor]) -> Dict[Tuple[int, int], Dict[str, torch.Tensor]]:
        """(stage, micro-batch) -> the user inputs that stage's program reads."""
        m = self.plan.num_microbatches
        per_mb: Dict[Tuple[int, int], Dict[str, torch.Tensor]] = defaultdict(dict)
        for s, ex in self.executors.items():
            prog = ex.program
            for name, idx in prog.user_inputs.items():
                t = user_inputs[idx].to(self.device, non_blocking=True)
                whole = t.dim() == 0 or name in prog.whole_inputs  # no batch dim (find_batch_dims)
                pieces = [t] * m if whole else t.tensor_split(m)
                for mb in range(m):
                    per_mb[(s, mb)][name] = pieces[mb]
            if prog.prologue is not None and not prog.prologue.in_plan:  # whole-batch values: a loss's token count
                totals = ex.prologue([per_mb[(s, mb)] for mb in range(m)])
                for mb in range(m):
                    per_mb[(s, mb)].update(totals)
        return per_mb

    def _run(self, user_inputs):
        if not self.plan.training:
            return self._run_plan(user_inputs)
        self.grad_hooks.set_aside()  # NOTE: Post-accumulate-grad hooks
        try:
            out = self._run_plan(user_inputs)
        except BaseException:
            self.grad_hooks.restore()
            raise
        self.grad_hooks.run()  # a step without clipping or optimizer: its gradients are final here
        return out

    def _run_plan(self, user_inputs):
        start = time.perf_counter()
        stats = StepStats()
        if self.captured is not None:
            self.captured.clear()
        recv_actors, send_actors = self._actors()
        for actor in recv_actors.values():
            actor.pump()
        step = StepValues(recv_actors, send_actors, stats)
        if self.plan.training and self.optimizer is not None:
            self._own_grads()
        if self.grad_scaler is not None and self.plan.training:  # NOTE: Loss scaling (graphc/amp.py)
            self.found_inf = None
            m = self.plan.num_microbatches
            for ex in self.executors.values():
                ex.loss_scale = self.grad_scaler.get_scale() * ex.program.loss_weight(m)
        if self.grad_sync is not None and self.plan.training:
            self.grad_sync.start_step()
        if self.zero is not None:
            self.zero.refresh()
        first = 0
        if self.step_graph is not None and self.captured is None:   # NOTE: CUDA graphs
            first = compute_prefix(self.plan)
            step.results.update(self.step_graph.run(user_inputs, lambda inputs: self._computes(inputs, step, first)))
        else:
            step.values = self._microbatches(user_inputs)
        profiling = torch.autograd.profiler._is_profiler_enabled  # checked once per step: cheap
        for i in range(first, len(self.plan.instructions)):
            self._execute(i, step, profiling)
        self.output_sums.finish(step.results)
        for actor in send_actors.values():
            actor.drain()
        for s, ex in self.executors.items():
            stats.max_live_activations[s] = ex.max_live
            if self.memory_stats:
                stats.max_live_bytes[s] = ex.max_live_bytes
            ex.max_live = ex.max_live_bytes = 0
        stats.compile_seconds = take_compile_seconds(self.compiled)
        stats.seconds = time.perf_counter() - start
        return dict(step.results), stats

    def _computes(self, user_inputs, step: "StepValues", n: int) -> Dict[str, List[torch.Tensor]]:
        """The plan's first n instructions, all compute: what a CUDA graph captures."""
        step.values = self._microbatches(user_inputs)
        for i in range(n):
            self._execute(i, step, False)
        return dict(step.results)

    def _execute(self, i: int, step: "StepValues", profiling: bool) -> None:
        """Runs instruction i of the plan."""
        ins, range_name = self.plan.instructions[i], self.range_names[i]
        t0 = time.perf_counter() if self.trace else 0.0
        for gather in self.prefetch.get(i, ()):
            self.zero.launch_gather(gather)
        if self.probe is not None:
            self.probe.before(i, step)
        with record_function(range_name) if profiling and range_name else _NO_RANGE:
            self.run_entries[ins.runs](ins, step)
        if self.probe is not None:
            self.probe.after(i, step)
        if self.trace:
            step.stats.events.append((str(ins), t0, time.perf_counter()))

    # Each instruction kind's run entry, named by its class (`runs`, graphc/plan/instructions.py):
    # Runtime._run_<runs>(instruction, step). A new kind adds its entry here.

    def _run_recv(self, ins: Recv, step: "StepValues") -> None:
        got = _assemble(ins, step.recv_actors[ins.peer].take(ins), step.assembling)
        if ins.direction == ACT:
            step.values[(ins.stage, ins.microbatch)].update(got)
        elif ins.direction == PRE:
            step.pre_received[(ins.stage, ins.microbatch)].update(got)
        else:
            step.grads[(ins.stage, ins.microbatch)].extend(got.items())

    def _run_send(self, ins: Send, step: "StepValues") -> None:
        step.send_actors[ins.peer].post(ins, step.produced[(ins.stage, ins.microbatch, ins.direction)])

    def _run_pre_pass(self, ins: PrePass, step: "StepValues") -> None:
        self.pre_passes.run(ins, step)

    def _run_overlap(self, ins: OverlapFB, step: "StepValues") -> None:
        """On one stream: the forward, then the backward."""
        self._run_forward(ins.forward, step)
        self._run_backward(ins.backward, step)

    def _run_forward(self, ins: Forward, step: "StepValues") -> None:
        s, mb = ins.stage, ins.microbatch
        ex = self.executors[s]
        with ex.computing(ACT, mb):   # its unit gathers and releases (NOTE: ZeRO units)
            outs = ex.forward(mb, step.values.pop((s, mb)))
        step.produced[(s, mb, ACT)] = outs
        if self.captured is not None:
            self.captured.append((str(ins), s, mb, {n: v.detach().clone() for n, v in outs.items()}))
        for name in ex.program.results:
            step.results[name].append(outs[name].detach())
        for b, names in self.local_acts[s]:
            step.values[(b, mb)].update({n: outs[n] for n in names})

    def _run_backward(self, ins: Backward, step: "StepValues") -> None:
        self._backward(ins, step, self.executors[ins.stage].backward)

    def _run_backward_input(self, ins: BackwardInput, step: "StepValues") -> None:
        self._backward(ins, step, self.executors[ins.stage].backward_input)

    def _run_backward_weight(self, ins: BackwardWeight, step: "StepValues") -> None:
        ex = self.executors[ins.stage]
        with ex.computing(ins.letter, ins.microbatch):   # it reads the units again (NOTE: ZeRO units)
            ex.backward_weight(ins.microbatch)

    def _backward(self, ins, step: "StepValues", run) -> None:
        """A whole backward or its input half: `run` on the gradients received for it."""
        s, mb = ins.stage, ins.microbatch
        with self.executors[s].computing(ins.letter, mb):   # B or I (NOTE: ZeRO units)
            got = run(mb, step.grads.pop((s, mb), []))
        step.produced[(s, mb, "B")] = got
        step.produced.pop((s, mb, ACT), None)
        for a, names in self.local_grads[s]:
            step.grads[(a, mb)].extend((n, got[n]) for n in names)

    def _run_optimizer_step(self, ins: OptimizerStep, step: "StepValues") -> None:
        for actor in step.send_actors.values():
            actor.drain()
        self.grad_hooks.run()  # gradients are final: where eager's hooks have run
        self._optimizer_step()

    def _run_clip_grad_norm(self, ins: ClipGradNorm, step: "StepValues") -> None:
        self.grad_hooks.run()
        self._unscale()
        self._clip_grad_norm(ins)

    def _run_inside_compute(self, ins, step: "StepValues") -> None:
        """A conversion or a unit event: run inside the compute listed before (NOTE: ZeRO units)."""

    def _run_all_gather(self, ins: AllGather, step: "StepValues") -> None:
        self.zero.gather(ins)

    def _run_release(self, ins: ReleaseParams, step: "StepValues") -> None:
        self.zero.release(ins)

    def _run_output_sum(self, ins: OutputAllReduce, step: "StepValues") -> None:
        self.output_sums.launch(ins, step.results)   # finished when the step ends

    def _run_grad_sync(self, ins: AllReduce, step: "StepValues") -> None:
        self.grad_sync.wait(ins)
