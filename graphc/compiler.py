"""compile(): the pass order, written once, read as phases.

  declare   the stages and layouts the user wrote down, checked before tracing
  trace     build() as one fx graph of the whole step (backward() a node)
  place     a pipeline stage, a per-micro-batch shape and the batch rows for every node
  shard     an SBP layout per node on its stage's mesh, every conversion explicit
  split     one fx program per stage, with its sends and receives
  schedule  and lower: every rank's execution plan (compute order, transfers,
            collectives), verified together

The steps' bodies live in graphc/passes/, one pass per file; this module holds the order,
and compile_values.py what compile() reads (CompileSpec) and produces (CompiledGraph). Each step
records its result and time in the compilation history (graphc/history.py).
GRAPHC_DEBUG levels: 1 a summary line, 2 adds each pass's time, 3 adds every rank's final
plan, 4 adds the whole history (graphs with their annotations, programs, plans), 5 also
checks every step's node annotations against their schemas (passes/verify_meta.py). They go
to the `graphc.compile` logger (graphc/log.py): rank 0 prints by default, GRAPHC_LOG_RANKS
chooses others.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.fx as fx

from . import env
from .history import PassRecord, record
from .log import get_logger
from .meta import META_GRAD_PARTIAL, META_SBP, META_STAGE, META_TENSOR, is_backward
from .passes.annotate_stages import annotate_stages
from .passes.build_tracer import CompileFakes
from .passes.check_layout import check_layout
from .passes.check_row_groups import check_row_groups
from .passes.collect_placed_stages import collect_placed_stages
from .passes.cast_to_traced_dtypes import cast_to_traced_dtypes
from .passes.collect_stages import collect_stages, traced_autocast
from .passes.decompose_modules import decompose_modules
from .passes.defer_batch_norm import defer_batch_norm
from .passes.feed_whole_batch import feed_whole_batch
from .passes.feed_whole_sums import feed_whole_sums
from .passes.find_batch_dims import find_batch_dims, input_names
from .passes.find_meshes import find_meshes
from .passes.find_plan_symmetry import find_plan_symmetry
from .passes.infer_sbp import infer_sbp
from .passes.insert_autocast_modes import insert_autocast_modes
from .passes.insert_boxing import insert_boxing
from .passes.insert_checkpoints import insert_checkpoints
from .passes.insert_grad_clip import insert_grad_clip
from .passes.insert_grad_modes import insert_grad_modes
from .passes.insert_grad_sync import insert_grad_sync
from .passes.insert_output_reduce import insert_output_reduce
from .passes.insert_tie_sync import insert_tie_sync
from .passes.insert_zero_sync import insert_zero_sync
from .passes.insert_zero_units import insert_zero_units
from .passes.warn_replicated_stages import warn_replicated_stages
from .passes.list_collectives import list_collectives
from .passes.localize_ops import localize_ops
from .passes.deal_zigzag import deal_zigzag
from .passes.lower_plan import lower_plan
from .passes.note_stages import note_stages
from .passes.place_by_layout import place_by_layout
from .passes.place_inputs import place_inputs
from .passes.check_batch_sizes import check_batch_sizes
from .passes.propagate_shapes import propagate_shapes
from .passes.seed_random_ops import seed_random_ops
from .passes.split_inputs import split_inputs
from .passes.split_stages import split_stages
from .passes.trace_build import TraceText, trace_build, traced_text
from .passes.verify_graph import verify_annotated, verify_traced, warn_unused_parameters
from .passes.verify_meta import MetaVerifier, graphs_in
from .placement import Layout
from .plan.plan import ExecutionPlan, StageInfo
from .plan.templates import PlanWorld, RowSymmetry, check_quotient, same_as_printed
from .plan.verify import verify_plans
from . import plan_cache
from .plan_cache import CompileKey
from .sbp.declared import META_DECLARED
# what compile() reads and produces (compile_values.py), imported from here too
from .compile_values import CompileSpec, CompiledGraph, ModuleSpec

__all__ = ["compile", "retrace", "compile_key", "debug_level", "op_sequence", "CompileSpec", "CompiledGraph",
           "ModuleSpec", "StageInfo"]


_log = get_logger("compile")
# what compile_key reads of each node: its shape and dtype, layout, stage, gradient sync
_ANNOTATIONS = (META_TENSOR, META_SBP, META_STAGE, META_GRAD_PARTIAL)


def debug_level() -> int:
    """GRAPHC_DEBUG (default 0): how much of the compilation to print (levels above)."""
    return env.read("GRAPHC_DEBUG")


SLOW_PASS_SECONDS = 1.0  # a pass slower than this is reported at a terminal, whatever GRAPHC_DEBUG


# NOTE: One fake mode per compile
# build() is traced on fake tensors, and propagate_shapes runs the graph on them again (each
# twice with accumulation: the whole batch, then a micro-batch). A fake of a parameter costs
# about a millisecond to make (torch's meta description of the real tensor), and a leaf
# module's call makes one of each of its parameters. One compile's traces and propagations
# therefore share one FakeTensorMode and one fake per parameter (CompileFakes,
# passes/build_tracer.py), kept for the compile (the mode's own memo holds fakes only while
# something else does). Only shapes, dtypes and requires_grad are read off them, and build()
# cannot write a parameter (NOTE: Tensors outside the trace); buffers, which build() may
# update in place, are faked anew by every pass, as before.
@dataclass
class _Compilation:
    """One compile() under way: its history and, at GRAPHC_DEBUG=5, the annotation checks
    run after every step (passes/verify_meta.py: NOTE: Annotation verifier)."""

    history: List[PassRecord] = field(default_factory=list)
    verifier: MetaVerifier = field(default_factory=MetaVerifier)
    # the fakes of every trace and shape propagation of this compile (NOTE: One fake mode per compile)
    fakes: CompileFakes = field(default_factory=CompileFakes)
    described: bool = True   # each step's result kept as text (NOTE: History of a rank's compile)
    whole: Optional[fx.GraphModule] = None   # build() traced for the whole batch (accumulation > 1)


# NOTE: History of a rank's compile
# A step's record shows its result as text (history.py), written when the step ends because
# later passes annotate the same graph in place. Writing it costs a rank's compile more than
# some passes (every node's annotations, meshes of thousands of ranks, after each of ~40
# steps), and a running rank never reads it: so a compile of some ranks' plans (a rank's
# own, at startup) records each step's name and time only, and the text where something
# reads it: a whole world's compile (graphc plan writes passes.txt) or GRAPHC_DEBUG >= 4.
def _step(run: _Compilation, name: str, fn: Callable, *args) -> Any:
    start = time.perf_counter()
    out = fn(*args)
    took = time.perf_counter() - start
    run.history.append(record(name, took, out if run.described else None))
    level = debug_level()
    if level >= 2:
        _log.debug("pass %s: %.1f ms", name, took * 1e3)
    elif took > SLOW_PASS_SECONDS and sys.stderr.isatty():  # progress on long compiles, at a terminal
        _log.info("pass %s took %.1f s", name, took)
    if level >= 4:
        _log.debug("%s", run.history[-1].text)
    if level >= 5:  # the graphs the step made (graph or stage programs), or else those it read
        for gm in graphs_in(out) or [g for arg in args for g in graphs_in(arg)]:
            run.verifier.check(name, gm)
    return out


def _declare_and_trace(run: _Compilation, spec, example_inputs, world_size: int, input_layouts):
    """compile()'s first phases: the stages and layouts declared, build() traced (its graph for
    one micro-batch, after the whole batch's where accumulation splits inputs)."""
    m = spec.gradient_accumulation_steps

    # ** declare: what the user wrote down, checked before anything is traced
    # the stages set_stage names (the trace's autocast device type comes from them)
    stages, stage_of_module = _step(run, "collect_stages", collect_stages, spec, world_size)
    # the layouts to_global gave the Graph's parameters and buffers, as they are now
    declared = _step(run, "declared_layouts", lambda: spec.declared)

    # ** trace: build() as one fx graph of the whole step, backward() a node, shapes constants
    batched = None
    if m > 1:  # inputs whose dim 0 is the batch size are split (NOTE: Batch split) ...
        whole = _step(run, "trace_build (whole batch)", trace_build, spec.root, example_inputs, 1,
                      None, spec.name, spec.source_file, traced_autocast(stages, spec.amp_dtype), run.fakes)
        run.whole_ops = op_sequence(whole)
        split = _step(run, "split_inputs", split_inputs, input_names(whole), example_inputs,
                      spec.whole_inputs, spec.name)
        # ... which the data flow on build() for the whole batch confirms, or refuses
        whole = _step(run, "propagate_shapes (whole batch)", propagate_shapes, whole, example_inputs, 1,
                      run.fakes)
        whole = _step(run, "find_batch_dims (whole batch)", find_batch_dims, whole, m, False, split)
        run.whole = whole   # the batch size's uses are compared with the plan's (check_batch_sizes)
        batched = split
        # batched inputs cut their rows into micro-batches alike (NOTE: Row groups)
        _step(run, "check_row_groups", check_row_groups, input_names(whole), batched, input_layouts, m)
    # the graph every later pass annotates, traced for one micro-batch's shapes
    gm = _step(run, "trace_build", trace_build, spec.root, example_inputs, m, batched,
               spec.name, spec.source_file, traced_autocast(stages, spec.amp_dtype), run.fakes)
    if m > 1 and run.whole_ops != op_sequence(gm):
        run.traces_differ = (run.whole_ops, op_sequence(gm))
    return stages, stage_of_module, declared, gm


def op_sequence(gm: fx.GraphModule) -> tuple:
    """A traced graph's ops in order, without shapes: (op, target) per node, to compare two
    traces of build() on different batch sizes."""
    return tuple((n.op, n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target)))
                 for n in gm.graph.nodes)


def retrace(spec: CompileSpec, example_inputs: Sequence[torch.Tensor], world_size: int,
            input_layouts: Sequence = ()) -> "TraceText":
    """build() traced again as compile() traced it, as text (NOTE: Retrace check)."""
    layouts = [Layout.of(layout) for layout in input_layouts]
    return traced_text(_declare_and_trace(_Compilation(described=False), spec, example_inputs, world_size, layouts)[3])


def _place(run: _Compilation, spec, gm, stages, stage_of_module, input_layouts, world_size: int,
           training: bool):
    """compile()'s place phase: every node's stage (META_STAGE), from set_stage or the
    placements; returns (gm, stages)."""
    if not stage_of_module:
        # without set_stage every op runs where its inputs and parameters are placed; each
        # placement is a stage, in data-flow order (NOTE: Stages from placements)
        gm = _step(run, "place_by_layout", place_by_layout, gm, input_layouts)
        stages = _step(run, "placed_stages", collect_placed_stages, gm, spec.pipeline_schedule,
                       world_size) or stages
    else:  # with set_stage, a GlobalTensor input starts on the stage of its placement
        gm = _step(run, "place_inputs", place_inputs, gm, input_layouts, stages)
    run.verifier.stage_count = len(stages)  # final from here on: META_STAGE ranges over them
    if training:  # the stages are final: their ranks must be a layout the schedule can run
        _step(run, "check_layout", check_layout, stages, stage_of_module, spec.pipeline_schedule)
    # set_stage (or the placements) and data flow give the remaining nodes their stage
    gm = _step(run, "annotate_stages", annotate_stages, gm, stage_of_module)
    return gm, stages


def stages_of(spec, example_inputs: Sequence[torch.Tensor], world_size: int,
              input_layouts: Sequence = ()) -> fx.GraphModule:
    """build() traced and placed only: the graph with every node's stage (META_STAGE), what
    compile() would give it, without sharding, splitting or lowering (a layout search asks
    where each input is read once per stage cut: NOTE: Layout search).

    Args and the spec's meaning as in compile(). Returns the annotated fx graph."""
    if not isinstance(spec, CompileSpec):
        spec = spec._compile_spec()
    input_layouts = [Layout.of(layout) for layout in input_layouts]
    run = _Compilation(described=False)
    stages, stage_of_module, _, gm = _declare_and_trace(run, spec, example_inputs, world_size, input_layouts)
    training = any(is_backward(n) for n in gm.graph.nodes)
    gm, _ = _place(run, spec, gm, stages, stage_of_module, input_layouts, world_size, training)
    return gm


def compile(spec, example_inputs: Sequence[torch.Tensor], world_size: int,
            input_layouts: Sequence = (), ranks: Optional[Sequence[int]] = None) -> CompiledGraph:
    """Compiles the spec's build() for a world of `world_size`: the stage programs of every
    stage, the plans of `ranks`.

    spec: a CompileSpec, or a Graph (its _compile_spec(), graph_spec.compile_spec, is taken here).
    input_layouts: per input, None (broadcast) or the Layout of a GlobalTensor input (a
    (placement, sbp) pair is read as one).
    ranks: whose plans to lower and verify; None: every rank's (graphc plan). A rank lowers
    its own (NOTE: Plans of some ranks, passes/lower_plan.py), and agrees with its peers at
    startup (runtime/agreement.py; NOTE: Plan digests).
    """
    if not isinstance(spec, CompileSpec):
        spec = spec._compile_spec()
    input_layouts = [Layout.of(layout) for layout in input_layouts]
    run = _Compilation(described=ranks is None or debug_level() >= 4)
    m = spec.gradient_accumulation_steps
    stages, stage_of_module, declared, gm = _declare_and_trace(run, spec, example_inputs, world_size, input_layouts)
    trace = traced_text(gm)   # what GRAPHC_RETRACE compares (NOTE: Retrace check)
    gm.meta[META_DECLARED] = declared   # the passes read them off the graph they annotate
    # reject what a static graph cannot hold (host syncs, several backward()) before placing it
    _step(run, "verify_traced", verify_traced, gm)
    # modules with parameters that build() never uses are said once (no rank owns them)
    _step(run, "warn_unused_parameters", warn_unused_parameters, spec.root, gm)
    training = any(is_backward(n) for n in gm.graph.nodes)

    # ** place: a stage for every node, then its per-micro-batch shape and batch rows
    gm, stages = _place(run, spec, gm, stages, stage_of_module, input_layouts, world_size, training)
    # per-micro-batch shapes, so every transfer's buffer is known before running
    gm = _step(run, "propagate_shapes", propagate_shapes, gm, example_inputs, m, run.fakes)
    # where each value holds the batch's rows (outputs merge over micro-batches by it)
    gm = _step(run, "find_batch_dims", find_batch_dims, gm, m, False)
    if m > 1:  # the batch's size read where the micro-batch's would mean something else: refused
        _step(run, "check_batch_sizes", check_batch_sizes, run.whole, gm, m)
    # data flows forward through stages and the loss is a scalar, before anything is sharded
    _step(run, "verify_annotated", verify_annotated, gm, stage_of_module, len(stages))

    # ** shard: an SBP layout per node on its stage's mesh, conversions made explicit
    # each stage's mesh: 2-D where a declared placement names its ranks as one
    meshes = _step(run, "declared_meshes", find_meshes, stages, spec, gm, input_layouts, declared)
    # nn layers as functional ops on get_attr parameters, so SBP rules see parameters
    gm = _step(run, "decompose_modules", decompose_modules, gm, meshes)
    # with deferred batch norm, running statistics take one whole-mini-batch update per step
    gm = _step(run, "defer_batch_norm", defer_batch_norm, gm, spec.deferred_batch_norm, m)
    # an SBP signature per node, cheapest by bytes moved, honouring the user's layouts
    # (with sequence parallelism, tensor-parallel activations split along the sequence;
    # with context parallelism, attention on a split sequence)
    gm = _step(run, "infer_sbp", infer_sbp, gm, meshes, [l.sbp if l else None for l in input_layouts], m,
               spec.sequence_parallel, spec.context_parallel)
    # a stage on several ranks with nothing split computes the same thing on each: said
    gm = _step(run, "warn_replicated_stages", warn_replicated_stages, gm, meshes)
    # every SBP mismatch becomes a collective (with its dual in backward)
    gm = _step(run, "insert_boxing", insert_boxing, gm)
    # ops reading global sizes (mean over a split dim, reshape) get their local form
    gm = _step(run, "localize_ops", localize_ops, gm, spec.expert_capacity)
    # load-balanced context parallelism: the sequence dealt zig-zag between inputs and outputs
    gm = _step(run, "deal_zigzag", deal_zigzag, gm)
    # random ops draw by layout, now final: replicas the same numbers, shards their own
    gm = _step(run, "seed_random_ops", seed_random_ops, gm)

    # ** split: one fx program per stage, with its sends and receives
    programs = _step(run, "split_stages", split_stages, gm, len(stages))
    # build()'s no_grad / enable_grad regions kept inside each stage program
    programs = _step(run, "insert_grad_modes", insert_grad_modes, programs, training)
    # build()'s torch.autocast regions kept inside each stage program (never dropped)
    programs = _step(run, "insert_autocast_modes", insert_autocast_modes, programs)
    # ... and every op in the dtype the trace gave it (a decomposed layer's pieces included)
    programs = _step(run, "cast_to_traced_dtypes", cast_to_traced_dtypes, programs)
    # inputs without a batch dim fed whole; token-mean losses divided by the whole batch's count
    programs = _step(run, "feed_whole_batch", feed_whole_batch, programs, gm, m)
    # sums combined nonlinearly (a router's token counts) read the whole batch's, by a pre-pass
    programs = _step(run, "feed_whole_sums", feed_whole_sums, programs, m)
    # modules marked for activation checkpointing run as recomputed regions (after grad modes)
    checkpointed = {name for name, c in spec.modules.items() if c.activation_checkpointing}
    programs = _step(run, "insert_checkpoints", insert_checkpoints, programs,
                     checkpointed if training else set())

    # ** schedule and lower: the plans of `ranks` (every rank's by default), or the cached ones
    key = _step(run, "compile_key", compile_key, spec, trace, gm, programs, example_inputs,
                input_layouts, world_size)
    plans = _plans(run, spec, key, gm, programs, stages, meshes, declared, training, world_size, ranks)
    if "stages" in plans[0].notes:  # found from placements: said once
        _log.info("%s: %s", spec.name, plans[0].notes["stages"])

    input_meta = [(tuple(t.shape), t.dtype) for t in example_inputs]
    compiled = CompiledGraph(gm, stages, programs, plans, training, m, input_meta, run.history, meshes,
                             trace=trace, world_size=world_size, key=key,
                             traces_differ=getattr(run, "traces_differ", None))
    if debug_level() >= 1:
        total = sum(r.seconds for r in run.history)
        _log.info("compiled %s: %d stage(s), %d micro-batch(es), schedule=%s, %s, %.0f ms",
                  spec.name, len(stages), m, spec.pipeline_schedule,
                  "training" if training else "inference", total * 1e3)
    if debug_level() >= 3:
        for plan in plans:
            _log.debug("%s", plan)
    return compiled


def _plans(run: _Compilation, spec: CompileSpec, key: CompileKey, gm, programs, stages, meshes,
           declared, training: bool, world_size: int, ranks) -> Sequence[ExecutionPlan]:
    """The plans of `ranks` from GRAPHC_PLAN_CACHE when an entry has this key (NOTE: Plan
    cache), else lowered (and then kept there). A whole world's plans (graphc plan) are
    not kept: millions of instructions, compiled once by a tool."""
    chosen = list(range(world_size)) if ranks is None else sorted(set(ranks))
    folder = plan_cache.cache_dir() if ranks is not None else None
    path = plan_cache.entry_path(folder, spec.name, f"{dict(key.parts)['inputs']} {world_size} {chosen}") \
        if folder else None
    plans = _step(run, "load_cached_plans", plan_cache.load_plans, path, key, chosen) if path else None
    if plans is None:
        plans = _lower(run, spec, gm, programs, stages, meshes, declared, training, world_size, ranks)
        if path:
            _step(run, "store_cached_plans", plan_cache.store_plans, path, key, plans)
    return plans


def _lower(run: _Compilation, spec: CompileSpec, gm, programs, stages, meshes, declared,
           training: bool, world_size: int, ranks) -> Sequence[ExecutionPlan]:
    """compile()'s last phase: the schedule lowered to the plans of `ranks`, then verified.
    The whole world's (ranks None) are lowered as templates where the layout allows (NOTE: Plan
    templates); else every rank's."""
    if ranks is None:
        # whether one row of replicas stands for every row (why not is kept in the history)
        symmetry = _step(run, "find_plan_symmetry", find_plan_symmetry, stages, meshes, gm, programs,
                         spec.zero_stage)
        if isinstance(symmetry, RowSymmetry):
            world = _lower_templates(run, spec, gm, programs, stages, meshes, declared, training,
                                     world_size, symmetry)
            if world is not None:
                return world
    plans = _lower_ranks(run, spec, gm, programs, stages, meshes, declared, training, world_size, ranks)
    # all plans together pair up and are free of deadlock, with every instruction in place
    _step(run, "verify_plans", verify_plans, plans, world_size)
    return plans


def _lower_templates(run: _Compilation, spec: CompileSpec, gm, programs, stages, meshes, declared,
                     training: bool, world_size: int, symmetry: RowSymmetry) -> Optional[PlanWorld]:
    """The whole world's plans as row 0's templates (NOTE: Plan templates), verified as the
    world's quotient; None (said in the log) where the last row, lowered too, is not their
    instance, or the templates name ranks of other rows."""
    chosen = symmetry.template_ranks(world_size)
    last = symmetry.row(symmetry.rows - 1)
    plans = _lower_ranks(run, spec, gm, programs, stages, meshes, declared, training, world_size, chosen + last)
    by_rank = {p.rank: p for p in plans}
    templates = [by_rank[r] for r in chosen]
    # transfers stay in a row, and each group is in row 0 or whole columns
    why = _step(run, "check_quotient", check_quotient, templates, symmetry)
    if why is None:   # the last row lowered is its templates renamed, as printed
        world = PlanWorld(templates, symmetry, world_size)
        why = next((f"rank {r}'s lowered plan is not its template's instance" for r in last
                    if not same_as_printed(world[r], by_rank[r])), None)
    if why is not None:
        _log.info("%s: plan templates not used (%s); lowering all %d ranks", spec.name, why, world_size)
        return None
    # the templates pair up and are free of deadlock as a world: so is the whole world
    _step(run, "verify_plans", verify_plans, templates, world_size, True)
    return PlanWorld(templates, symmetry, world_size)


def _lower_ranks(run: _Compilation, spec: CompileSpec, gm, programs, stages, meshes, declared,
                 training: bool, world_size: int, ranks) -> List[ExecutionPlan]:
    """The plans of `ranks` (None: every rank's): the schedule's compute order, transfers,
    gradient syncs and listed collectives, not yet verified."""
    m = spec.gradient_accumulation_steps
    # the schedule's compute order, with point-to-point sends and receives around it
    plans = _step(run, "lower_plan", lower_plan, programs, stages, spec.pipeline_schedule, m,
                  training, world_size, spec.activation_checkpointing, ranks)
    # all-reduce of partial_sum gradients (data parallel), bucketed, before the step
    # (under set_param_dtype gradients are held by the float32 masters: NOTE: Master parameters)
    grad_dtype = torch.float32 if spec.param_dtype is not None else None
    plans = _step(run, "insert_grad_sync", insert_grad_sync, plans, gm,
                  spec.gradient_bucket_bytes, spec.grad_reduce_dtype, grad_dtype)
    # under ZeRO, sharded parameters' gradients reduce-scattered instead, gathered after the step
    plans = _step(run, "insert_zero_sync", insert_zero_sync, plans, gm, spec.zero_stage,
                  spec.zero_shard_min_size, spec.gradient_bucket_bytes)
    # stage 3 with units: each unit gathered and freed inside the computes, where it is used
    plans = _step(run, "insert_zero_units", insert_zero_units, plans, programs, spec.zero_units)
    # a parameter held by several stages (tied): its gradients summed over them, after grad sync
    plans = _step(run, "insert_tie_sync", insert_tie_sync, plans, programs, stages, grad_dtype)
    # clipping by the global grad norm (one scalar all-reduce), once gradients are final
    plans = _step(run, "insert_grad_clip", insert_grad_clip, plans, programs, meshes,
                  spec.grad_clip_norm, declared, grad_dtype)
    # build()'s partial_sum results (a data-parallel loss) summed once a step, not per micro-batch
    plans = _step(run, "insert_output_reduce", insert_output_reduce, plans, gm)
    # each conversion's collectives listed where its compute issues them (SBP, ranks, bytes)
    plans = _step(run, "list_collectives", list_collectives, plans, programs)
    # the stages nobody wrote down (found from placements), kept on every rank's plan
    return _step(run, "note_stages", note_stages, plans, gm, world_size)


def compile_key(spec: CompileSpec, trace: "TraceText", gm: fx.GraphModule, programs, example_inputs,
                input_layouts, world_size: int) -> CompileKey:
    """Everything the plans are made of, hashed by part (NOTE: Plan cache)."""
    settings = {f: getattr(spec, f) for f in spec.__dataclass_fields__ if f not in ("root", "source_file")}
    annotated = "\n".join(f"{n.name} {n.op} {n.target} " + " ".join(
        f"{k}={n.meta[k]}" for k in _ANNOTATIONS if k in n.meta) for n in gm.graph.nodes)
    return CompileKey.of({
        "build() trace": "\n".join(trace.lines),
        "annotated graph": annotated,
        "stage programs": "\n".join(str(p) for p in programs),
        "settings": repr(settings),
        "inputs": repr([(tuple(t.shape), t.dtype, str(layout)) for t, layout in zip(example_inputs, input_layouts)]),
        "world": str(world_size),
        "graphc and torch": plan_cache.graphc_sources(),
    })
