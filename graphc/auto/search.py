"""`search`: the layout for N ranks that the simulator says is fastest among those that fit.

NOTE: Layout search
The search runs in two rounds, both deterministic (every rank of a job finds the same):
  1. Estimate every candidate on paper, from one compile of the model on one rank (its
     forward seconds on the device preset, saved-activation bytes, parameter bytes and the
     optimizer's state count): pipeline degree x tensor degree x data degree = N (tensor
     parallel only where each layer has Megatron pairs that divide), the schedule (GPipe,
     1F1B, and with 2 stages per rank interleaved 1F1B and ZB-V), the micro-batches (p, 2p,
     4p; 1, 2, 4 without a pipeline), ZeRO 0-3 with data parallelism, checkpointing off or
     on. The step is the schedule's textbook makespan over the compute plus the gradient
     all-reduce and tensor parallelism's all-reduces (NOTE: Auto estimate in estimate.py); the memory is
     the model state as ZeRO lays it out plus the activations of the micro-batches in flight.
  2. Compile the best `top` estimates that fit for N ranks (apply_layout), run the
     simulator on the device preset (every rank's plan, every collective) and the memory
     model (NOTE: Peak memory model) on each: the winner is the fastest whose every rank
     fits. Its plans are verified by the compile like any plan. Each compile corrects the
     memory estimates of its kind, and a candidate then predicted not to fit is skipped
     (NOTE: Memory check of the search in fit.py).
A budget in seconds bounds the search once a compiled layout fits: no compile starts that
would end past it, by the longest compile so far (each costs ~1 s on a small model, 7-20 s
for 64 ranks of a Llama-3-8B on the shared 2-core machine); a progress line goes to stderr
per candidate. A model that fits no candidate is refused, naming the
memory the memory model finds its least-estimated layout needs.
"""
from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field, replace
from typing import List, Optional, Sequence

from ..errors import GraphcError
from .estimate import ModelFacts, ends_share, estimate
from .fit import MemoryCheck, refuse_none_fit
from .layout import (Layout, apply_layout, batch_layouts, batched_inputs, input_stages, layer_list,
                     megatron_pairs, with_layers)
from .order import CompileOrder, checkpointed

SCHEDULE_CHOICES = ("1f1b", "gpipe", "interleaved_1f1b", "zbv")


@dataclass
class Candidate:
    layout: Layout
    est_step: float
    est_memory: int
    step: Optional[float] = None         # simulated (round 2)
    peak: Optional[int] = None           # the memory model's highest rank
    peak_rank: Optional[int] = None
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.note == ""


@dataclass
class AutoResult:
    best: Candidate
    compiled: object                     # the winner's CompiledGraph
    tried: List[Candidate] = field(default_factory=list)    # compiled and simulated
    unfit: List[Candidate] = field(default_factory=list)    # estimated not to fit
    considered: int = 0
    seconds: float = 0.0
    device: str = "h100"
    memory: int = 0
    skipped: List[Candidate] = field(default_factory=list)  # predicted not to fit (NOTE: Memory check of the search)

    def report(self) -> str:
        """auto.md: the winner, the candidates simulated, and what did not fit."""
        mib = 2 ** 20
        lines = [f"# Automatic layout: {self.best.layout.describe()}", "",
                 f"{self.considered} candidates estimated, {len(self.tried)} compiled and simulated "
                 f"on {self.device} with {self.memory / 2**20:.1f} MiB per rank, in {self.seconds:.1f} s "
                 "(NOTE: Layout search in graphc/auto/search.py).", "",
                 "| layout | estimated step ms | simulated step ms | peak MiB (rank) | |",
                 "|---|---|---|---|---|"]
        for c in sorted(self.tried, key=lambda c: (not c.fits, c.step if c.step is not None else 1e30)):
            mark = "**winner**" if c is self.best else c.note
            step = f"{c.step * 1e3:.3f}" if c.step is not None else "-"
            peak = f"{c.peak / mib:.1f} ({c.peak_rank})" if c.peak is not None else "-"
            lines.append(f"| {c.layout.describe()} | {c.est_step * 1e3:.3f} | {step} | {peak} | {mark} |")
        won = [c for c in self.tried if c.fits and c is not self.best and c.step is not None]
        if won:
            runner = min(won, key=lambda c: c.step)
            lines += ["", f"The winner's simulated step is {runner.step / self.best.step:.2f}x faster "
                      f"than the runner-up ({runner.layout.describe()})."]
        if self.skipped:
            lines += ["", f"{len(self.skipped)} candidates were skipped, predicted not to fit by the memory "
                      "model's ratio to the estimate for their kind (NOTE: Memory check of the search), e.g.:"]
            lines += [f"- {c.layout.describe()}: {c.note}" for c in self.skipped[:5]]
        if self.unfit:
            lines += ["", f"{len(self.unfit)} candidates were estimated not to fit, e.g.:"]
            for c in sorted(self.unfit, key=lambda c: c.est_step)[:5]:
                lines.append(f"- {c.layout.describe()}: about {c.est_memory / mib:.1f} MiB per rank")
        return "\n".join(lines) + "\n"


def search(spec, example_inputs: Sequence, nproc: int, batched: Sequence[bool],
           optimizer=None, device: str = "h100", memory: Optional[int] = None,
           budget_s: Optional[float] = 60.0, top: int = 8, progress: bool = True) -> AutoResult:
    """The fastest layout of `spec` on `nproc` ranks of `device` that fits `memory` bytes per
    rank (None: the device's memory) (See NOTE: Layout search).

    batched: per input, whether it is split over the data-parallel ranks (its dim 0 the batch).
    budget_s: seconds for round 2; None: no bound but `top` (the same answer on any machine).
    top: layouts compiled; both bounds end the search once one fits by the memory model
    (until then it goes on, skipping what the memory check predicts too big)."""
    from ..tools.costs import DEVICES
    if device not in DEVICES:
        raise GraphcError(f"graphc plan --auto: unknown device {device!r}; choose one of {sorted(DEVICES)}")
    capacity = int(memory if memory is not None else DEVICES[device].memory_gib * 2 ** 30)
    t0 = time.perf_counter()
    facts = model_facts(spec, example_inputs, optimizer, device)
    candidates = [Candidate(lay, *estimate(lay, facts)) for lay in enumerate_layouts(facts, nproc, spec.root)]
    fitting = [c for c in candidates if c.est_memory <= capacity]
    unfit = [c for c in candidates if c.est_memory > capacity]
    if not fitting:
        _refuse_unfit(spec, candidates, nproc, capacity, (example_inputs, batched, optimizer, device))
    fitting.sort(key=lambda c: (c.est_step, c.est_memory, c.layout.describe()))
    tried: List[Candidate] = []
    skipped: List[Candidate] = []
    check = MemoryCheck(capacity)     # NOTE: Memory check of the search
    best, best_compiled = None, None
    longest = 0.0             # the longest compile so far
    read_at: dict = {}        # stage cut -> the stage reading each input
    job = (spec, example_inputs, nproc, batched, optimizer, device, capacity, read_at)
    order = CompileOrder(fitting)
    for c in order:
        # `top` and the budget end the search once a layout fits, and no compile starts that
        # would end past the budget (by the longest so far: compiles' times vary)
        if best is not None and (len(tried) >= top or budget_s is not None and
                                 time.perf_counter() - t0 + longest > budget_s):
            _say(progress, f"graphc auto: {len(tried)} candidates compiled in {time.perf_counter() - t0:.0f} s")
            break
        if check.skips(c):
            skipped.append(c)
            continue
        started = time.perf_counter()
        compiled = _score(c, order.sibling(c), job)
        if compiled is not None:
            longest = max(longest, time.perf_counter() - started)
        check.learn(c)
        tried.append(c)
        _say(progress, f"graphc auto: [{len(tried)}/{min(top, len(fitting))}] {c.layout.describe():<36} "
                       f"step {c.step * 1e3 if c.step is not None else float('nan'):8.3f} ms  "
                       f"peak {(c.peak or 0) / 2**20:9.1f} MiB  {c.note}")
        if c.fits and c.step is not None and (best is None or c.step < best.step):
            best, best_compiled = c, compiled
        order.after(c, compiled, best)
    if best is None:
        refuse_none_fit(spec.name, tried, skipped, check)
    if best_compiled is None:     # a twin won: its own compile, for its plans and their checks
        best_compiled = _simulate(best, *job)
    return AutoResult(best, best_compiled, tried, unfit, len(candidates), time.perf_counter() - t0,
                      device, capacity, skipped)


def _score(c: Candidate, sibling, job: tuple):
    """Round 2 for one candidate; returns its CompiledGraph (None: a twin, scored on its
    sibling's plans with its own checkpointing: NOTE: Memory check of the search)."""
    if sibling is None:
        return _simulate(c, *job)
    optimizer, device, capacity = job[4:7]
    judge(c, sibling, checkpointed(sibling.plans, c.layout), optimizer, device, capacity)
    return None


def _refuse_unfit(spec, candidates: List[Candidate], nproc: int, capacity: int, job: tuple) -> None:
    """No estimate fits: the least estimate's layout compiled, and its memory model's peak named
    (the estimate may be optimistic; NOTE: Memory check of the search)."""
    if not candidates:
        raise GraphcError(f"{spec.name}: no layout on {nproc} ranks: nothing divides the batch and the ranks")
    least = min(candidates, key=lambda c: (c.est_memory, c.est_step))
    inputs, batched, optimizer, device = job
    _simulate(least, spec, inputs, nproc, batched, optimizer, device, capacity, {})
    need = max(least.peak or 0, least.est_memory)
    by = "the memory model" if least.peak is not None else f"its estimate ({least.note})"
    raise GraphcError(f"{spec.name}: no layout on {nproc} ranks fits {capacity / 2**30:.2f} GiB per "
                      f"rank (the least estimated, {least.layout.describe()}, needs {need / 2**30:.3g} GiB "
                      f"by {by}). Fix: more ranks, a device with more memory (--memory "
                      f"{need / 2**30 * 1.05:.3g}), or a smaller batch")


def _say(progress: bool, line: str) -> None:
    if progress:
        print(line, file=sys.stderr, flush=True)


def _simulate(c: Candidate, spec, inputs, nproc, batched, optimizer, device, capacity, read_at: dict):
    """Round 2 for one candidate: compile, simulate, memory model; fills step / peak / note."""
    from ..compiler import compile as compile_graph
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            laid = batch_layouts(c.layout, inputs, batched, _stages_read(spec, inputs, c.layout, read_at))
            compiled = compile_graph(apply_layout(spec, c.layout), inputs, nproc, laid)
    except GraphcError as exc:
        c.note = f"refused: {str(exc).splitlines()[0][:120]}"
        return None
    judge(c, compiled, compiled.plans, optimizer, device, capacity)
    return compiled


def judge(c: Candidate, compiled, plans, optimizer, device: str, capacity: int) -> None:
    """The simulator's step and the memory model's peak of `plans` (those of `compiled`, or
    its plans with another checkpointing: benchmarks/auto_paper.py); fills step / peak / note."""
    from ..tools.costs import device_costs
    from ..tools.simulate import model_inputs, simulate
    result = simulate(plans, device_costs(compiled, device), model=model_inputs(compiled, optimizer))
    worst = max((r for r in result.ranks if r.memory is not None), key=lambda r: r.memory.peak)
    c.step, c.peak, c.peak_rank = result.step_time, worst.memory.peak, worst.rank
    if c.peak > capacity:
        c.note = f"does not fit: rank {worst.rank} needs {c.peak / 2**20:.1f} MiB"


def _stages_read(spec, inputs, layout: Layout, known: dict):
    """input_stages, once per stage cut and schedule (its placement of stages) in a search."""
    key = (layout.pp, layout.schedule if layout.chunks > 1 else "", layout.boundaries)
    if key not in known:
        known[key] = input_stages(spec, inputs, layout)
    return known[key]


def model_facts(spec, inputs, optimizer, device: str) -> ModelFacts:
    """One compile on one rank: the estimates' inputs."""
    from ..compiler import compile as compile_graph
    from ..tools.costs import DEVICES, device_costs
    from ..tools.simulate import model_inputs
    one = replace(spec, modules={}, declared=type(spec.declared)({}), gradient_accumulation_steps=1,
                  zero_stage=0, activation_checkpointing="never")
    compiled = compile_graph(one, inputs, 1)
    costs = device_costs(compiled, device)
    params = model_inputs(compiled, optimizer).params[0]
    states = max((p.states for p in params if p.trained), default=2)
    _, layers = layer_list(spec.root)
    degrees = tuple(t for t in (2, 4, 8) if layers and all(megatron_pairs(l, t)[0] for l in layers))
    rows = next((t.shape[0] for t in inputs if hasattr(t, "shape") and len(t.shape) > 0), 1)
    dev = DEVICES[device]
    forward = sum(costs.forward.values())
    host = forward - sum(device_costs(compiled, device, op_us=0).forward.values()) if dev.op_us else 0.0
    return ModelFacts(forward - host, sum(costs.activation_bytes.values()),
                      sum(p.nbytes for p in params), states, len(layers), degrees, rows,
                      dev.link_gbps * 1e9, dev.latency_us * 1e-6, host, dev.instruction_us * 1e-6,
                      dev.collective_us * 1e-6, dev.p2p_us * 1e-6, dev.cores_per_node, dev.gpus_per_node,
                      dev.handoff_us * 1e-6, dev.net_gbps * 1e9, dev.net_latency_us * 1e-6,
                      ends_share(spec.root))


def enumerate_layouts(facts: ModelFacts, nproc: int, root) -> List[Layout]:
    """Every candidate layout on nproc ranks (See NOTE: Layout search)."""
    out = []
    for pp in _divisors(nproc):
        for tp in _divisors(nproc // pp):
            dp = nproc // pp // tp
            if tp > 1 and tp not in facts.tp_degrees or facts.rows % dp:
                continue
            for schedule in (SCHEDULE_CHOICES if pp > 1 else ("1f1b",)):
                chunks = 2 if schedule in ("interleaved_1f1b", "zbv") else 1
                if pp * chunks > facts.layers or (pp == 1 and chunks > 1):
                    continue
                for m in ((pp, 2 * pp, 4 * pp) if pp > 1 else (1, 2, 4)):
                    if (facts.rows // dp) % m:
                        continue
                    for zero in ((0, 1, 2, 3) if dp > 1 else (0,)):
                        for ckpt in ("never", "always"):
                            out.append(with_layers(Layout(pp, tp, dp, schedule, m, zero, ckpt), root))
    return out


def _divisors(n: int) -> List[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def run_time_layout(spec, inputs: Sequence, nproc: int, batched: Sequence[bool], optimizer, request) -> Layout:
    """What enable_auto_parallel trains on (See NOTE: Run-time search in layout.py): the
    cached answer for this model and cluster (NOTE: Search cache), else a search bounded by
    `request.top` candidates alone, so that any rank would find the same; stored for next time."""
    from ..tools.costs import DEVICES
    from .cache import cache_folder, entry_path, load_layout, search_key, store_layout
    if request.device not in DEVICES:
        raise GraphcError(f"enable_auto_parallel: unknown device {request.device!r}; choose one of {sorted(DEVICES)}")
    memory = int(request.memory_gib * 2 ** 30) if request.memory_gib is not None else \
        int(DEVICES[request.device].memory_gib * 2 ** 30)
    key = search_key(spec, inputs, nproc, batched, optimizer, repr(DEVICES[request.device]), memory, request.top)
    path = entry_path(cache_folder(request.cache), spec.name, key)
    cached = load_layout(path, key)
    if cached is not None:
        _say(True, f"graphc auto: {spec.name}: {cached.describe()} from the search cache ({path})")
        return cached
    # each candidate's trace leaves its constants on the root it traces (_tensor_constant<i>):
    # a shallow copy takes them, so rank 0's own compile then names them as the others' do
    searched = replace(spec, root=copy.copy(spec.root))
    result = search(searched, inputs, nproc, batched, optimizer, request.device, memory, budget_s=None,
                    top=request.top)
    store_layout(path, key, result.best.layout, result.report())
    _say(True, f"graphc auto: {spec.name}: {result.best.layout.describe()} (searched in "
               f"{result.seconds:.1f} s; kept in {path})")
    return result.best.layout


def plan_mode_search(device: str = "h100", memory_gib: Optional[float] = None, budget_s: float = 60.0):
    """What `graphc plan --auto` installs in plan mode (PlanMode.auto): for the graph the
    script compiles, search, write DIR/layout.json and DIR/auto.md, and return (the chosen
    Layout, its CompiledGraph) for the plan files."""
    import inspect
    import os
    from ..executable import _as_traced

    def run(graph, spec, specs, tree, mode):
        examples = [s.example() for s in specs]
        names = tree.names if tree is not None else list(inspect.signature(type(graph).build).parameters)[1:]
        batched = batched_inputs(examples, names, spec.whole_inputs)
        memory = None if memory_gib is None else int(memory_gib * 2 ** 30)
        with _as_traced(spec, tree):
            result = search(spec, examples, mode.nproc, batched, graph._optimizer, device, memory, budget_s)
        folder = mode.folder_for(graph)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "layout.json"), "w") as f:
            f.write(result.best.layout.to_json())
        with open(os.path.join(folder, "auto.md"), "w") as f:
            f.write(result.report())
        print(f"graphc plan --auto: {type(graph).__name__}: {result.best.layout.describe()} "
              f"(simulated step {result.best.step * 1e3:.3f} ms on {device}, peak "
              f"{result.best.peak / 2**20:.1f} MiB); wrote {folder}/layout.json and auto.md; "
              f"train with self.config.load_layout('{os.path.join(folder, 'layout.json')}')", flush=True)
        return result.best.layout, result.compiled
    return run
