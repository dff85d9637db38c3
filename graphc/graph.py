"""graphc.Graph: the user's entry point (see README.md, "The API by example")."""
from __future__ import annotations

import inspect
from typing import Any, Dict, List

import torch
import torch.fx as fx
import torch.nn as nn

from . import compiler, plan_mode
from .block import ModuleBlock
from .check_step import FirstStepCheck, optimizer_groups, warn_if_random
from .config import GraphConfig
from .dcp import dcp_state_dict, user_prefix
from .errors import GraphcError
from .global_tensor import GlobalTensor, declared_layout, global_from_local
from .guards import (MISSING, GuardSet, current_log, difference, fingerprint, global_guards, record_reads,
                     structure_of)
from .log import get_logger, warn_user
from .meta import META_ROWS, META_SBP, META_STAGE, META_TENSOR
from .placement import placement as Placement
from .plan.ops import compiled_groups, create_groups
from .plan.plan import ExecutionPlan
from .runtime.actors import Runtime
from .sbp.declared import DeclaredLayouts
from .runtime.comm import P2P
from .runtime.agreement import check_agreement, fingerprint_tensor, step_facts
from .runtime.rng import agree_base_seed
from .runtime.trace import Tracer
from .runtime.dist_env import device_for, ensure_process_group, timeout_seconds
from .runtime.watchdog import run_step
from .sbp.layout import is_even
from .state import GraphState, check_state_dict


_CREATED: Dict[str, int] = {}  # Graph subclass name -> instances created in this process
_log = get_logger("guards")
# plans kept per input signature before a warning: a value that changes on every call
# (a counter read by build()) would otherwise compile on every call, unseen (torch.compile's
# cache_size_limit is 8 for the same reason)
_PLANS_PER_SIGNATURE = 8


class _BuildRoot(nn.Module):
    """The nn.Module traced for build(): holds the user's modules under their names.

    Attribute lookups that are not modules fall back to the Graph, so build() can use
    the Graph's other attributes and helper methods.
    """

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            graph = self.__dict__.get("_graphc_graph")
            if graph is None:
                raise
            value = getattr(graph, name)
            log = current_log()
            if log is not None and name in graph.__dict__:  # baked into the trace: guarded (NOTE: Guards)
                log.note(graph, name, value, prefix="self")
            return value


class Graph:
    """A static training (or inference) step compiled from `build()`.

    Subclass it, assign modules in `__init__`, optionally mark pipeline stages and
    accumulation, add an optimizer, and write `build()`; each call runs one step.

    Example:
        class TrainGraph(graphc.Graph):
            def __init__(self, model, opt):
                super().__init__()
                self.model = model
                self.model.stage0.config.set_stage(0, graphc.placement("cpu", [0]))
                self.model.stage1.config.set_stage(1, graphc.placement("cpu", [1]))
                self.config.set_gradient_accumulation_steps(4)
                self.add_optimizer(opt)

            def build(self, x, y):
                loss = F.cross_entropy(self.model(x), y)
                loss.backward()
                return loss

        loss = TrainGraph(model, opt)(x, y).to_local()
    """

    def __init__(self):
        root_cls = type(f"{type(self).__name__}Build", (_BuildRoot,), {"forward": type(self).build})
        root = root_cls()
        object.__setattr__(root, "_graphc_graph", self)
        object.__setattr__(self, "_root", root)
        object.__setattr__(self, "_module_configs", {})
        object.__setattr__(self, "_compiled", None)
        object.__setattr__(self, "config", GraphConfig(self))
        object.__setattr__(self, "_optimizer", None)
        object.__setattr__(self, "_lr_scheduler", None)
        object.__setattr__(self, "_runtime", None)
        object.__setattr__(self, "_state", None)
        object.__setattr__(self, "_pending_state", None)
        object.__setattr__(self, "_rank", 0)
        object.__setattr__(self, "last_stats", None)
        object.__setattr__(self, "_tracer", None)
        # per input signature (shapes, dtypes, layouts): [(compiled graph, runtime, tracer)],
        # one entry per set of guarded values (NOTE: Guards); the current one is _compiled / _runtime
        object.__setattr__(self, "_plans_by_shape", {})
        object.__setattr__(self, "recompiles", [])  # why each plan after the first was compiled
        object.__setattr__(self, "_key", None)
        object.__setattr__(self, "_base_seed", 0)  # rank 0's torch.initial_seed(), agreed at compile
        object.__setattr__(self, "_forward_calls", 0)
        # this graph's name in rank agreement: class and creation order, the same on every rank
        _CREATED[type(self).__name__] = _CREATED.get(type(self).__name__, 0) + 1
        object.__setattr__(self, "_instance", f"{type(self).__name__}-{_CREATED[type(self).__name__]}")

    # -- modules ---------------------------------------------------------------------
    def __setattr__(self, name: str, value) -> None:
        if "_root" not in self.__dict__:
            raise GraphcError(f"{type(self).__name__}.__init__ must call super().__init__() "
                              f"before assigning '{name}'")
        if isinstance(value, ModuleBlock):
            value = value.origin
        if isinstance(value, nn.Module):
            if self._compiled is not None:
                raise GraphcError(f"module '{name}' was assigned after the graph was compiled; "
                                  "assign modules in __init__")
            self._root.add_module(name, value)
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str):
        root = self.__dict__.get("_root")
        if root is not None and name in root._modules:
            return ModuleBlock(root._modules[name], name, self)
        raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")

    def build(self, *args):
        """Override: the step, written as eager PyTorch on whole (global) tensors."""
        graph = self.__dict__.get("_graphc_graph", self)  # build() runs with the traced root as self
        raise GraphcError(f"{type(graph).__name__} must define build(self, ...)")

    def add_optimizer(self, optimizer: torch.optim.Optimizer, lr_sch=None) -> None:
        """The graph calls optimizer.step(), zero_grad() and lr_sch.step() once per call."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise GraphcError(f"add_optimizer expects a torch.optim.Optimizer, found {type(optimizer).__name__}. "
                              "Fix: pass the optimizer, e.g. torch.optim.SGD(model.parameters(), lr=0.1).")
        if self._optimizer is not None:
            raise GraphcError("add_optimizer was called twice; graphc supports one optimizer per graph")
        _check_optimizer(optimizer, lr_sch)
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_lr_scheduler", lr_sch)

    # -- compile and run -------------------------------------------------------------
    def _declared_layouts(self) -> DeclaredLayouts:
        """A snapshot of what to_global declared for this Graph's parameters and buffers, by
        every name each has (a tied weight under each), for the compiler to read."""
        root = self._root
        named = (list(root.named_parameters(remove_duplicate=False))
                 + list(root.named_buffers(remove_duplicate=False)))
        return DeclaredLayouts({name: layout for name, t in named for layout in [declared_layout(t)] if layout})

    def _compile_spec(self) -> compiler.CompileSpec:
        """What compiler.compile reads of this Graph, taken now: the traced root, the options
        and per-module settings, and the declared layouts (_declared_layouts)."""
        cfg = self.config
        modules = {name: compiler.ModuleSpec(c.stage_id, c.placement, c.activation_checkpointing)
                   for name, c in self._module_configs.items()}
        return compiler.CompileSpec(
            name=type(self).__name__, source_file=_source_file(type(self)), root=self._root,
            modules=modules, declared=self._declared_layouts(),
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            pipeline_schedule=cfg.pipeline_schedule, deferred_batch_norm=cfg.deferred_batch_norm,
            gradient_bucket_bytes=cfg.gradient_bucket_bytes, grad_clip_norm=cfg.grad_clip_norm,
            activation_checkpointing=cfg.activation_checkpointing, whole_inputs=cfg.whole_inputs)

    def compile(self, *inputs) -> ExecutionPlan:
        """Compiles for these example inputs without running a step; returns this rank's plan."""
        if self._compiled is None:
            self._compile(_local_and_global(inputs))
        return self.plan

    def __call__(self, *inputs):
        args = _local_and_global(inputs)
        check = None
        if self._compiled is None:
            if self.config.check_microbatching:  # NOTE: Checked first step
                check = FirstStepCheck(self, optimizer_groups(self))
            self._compile(args)
        elif self._runtime is not None:  # (plan mode has no runtime: it stops just below)
            self._check_inputs(args)
            self._select_plan(args)
        if self._runtime is None:  # plan mode (graphc plan): plans written, no training
            plan_mode.stop_before_step(self)
        if check is not None and not warn_if_random(self._compiled):
            check.start(inputs)
        else:
            check = None
        self._set_draw()
        results, stats = run_step(self._runtime.step, [local for local, _ in args])
        object.__setattr__(self, "last_stats", stats)
        self._tracer.after_step(stats)
        self._state.steps += 1 if self._compiled.training else 0
        if not self._compiled.training:
            object.__setattr__(self, "_forward_calls", self._forward_calls + 1)
        outputs = self._outputs(results)
        if check is not None:
            check.compare(outputs)
        return outputs

    @property
    def plan(self) -> ExecutionPlan:
        """This rank's compiled ExecutionPlan."""
        if self._compiled is None:
            raise GraphcError("the graph is not compiled yet; call graph(*inputs) or "
                              "graph.compile(*inputs) first")
        return self._compiled.plan_for(self._rank)

    @property
    def compiled(self) -> compiler.CompiledGraph:
        if self._compiled is None:
            raise GraphcError("the graph is not compiled yet; call graph.compile(*inputs) first")
        return self._compiled

    def _compile(self, args) -> None:
        mode = plan_mode.active()
        if mode is not None:  # graphc plan: compile for N ranks here, write, no process group
            compiled = self._trace_and_compile(args, mode.nproc)
            mode.write_graph(self, compiled)  # the tools' writer (See NOTE: Plan-mode writer)
            object.__setattr__(self, "_compiled", compiled)
            return
        _check_cuda_available(self, args)  # before torch's own AssertionError, on every rank
        device_types = {where.type for _, where in _named_placements(self, args)}  # set_stage or not
        rank, world = ensure_process_group(device_types or {"cpu"})
        compiled = self._trace_and_compile(args, world)
        _check_input_placements(compiled, args)
        object.__setattr__(self, "_rank", rank)
        object.__setattr__(self, "_compiled", compiled)
        self._setup_runtime(compiled, rank)
        # after a pending checkpoint is loaded: it names the run's base seed (or its RNG state,
        # from older graphc, carries the run's initial seed)
        seed = agree_base_seed(self._instance, timeout_seconds())
        object.__setattr__(self, "_base_seed", seed if self._state.base_seed is None else self._state.base_seed)
        object.__setattr__(self, "_key", _signature(args))
        self._plans_by_shape[self._key] = [(compiled, self._runtime, self._tracer)]

    def _trace_and_compile(self, args, world: int) -> compiler.CompiledGraph:
        """compiler.compile for these inputs' global shapes and layouts, with the guards of
        every Python value the compile read (NOTE: Guards)."""
        example, layouts = _compile_inputs(args)
        before = global_guards()  # the modes the caller set, before tracing changes any
        with record_reads(self._root) as reads:
            compiled = compiler.compile(self._compile_spec(), example, world, layouts)
        compiled.guards = GuardSet(tuple(before + structure_of(self._root) + reads.guards()))
        return compiled

    def _select_plan(self, args) -> None:
        """A new input shape, or a Python value build() read that changed (NOTE: Guards),
        selects (or compiles and caches) another plan.

        Every rank calls the graph with the same program, so every rank changes plan at the
        same call (compiling is deterministic; new process groups are created collectively).
        """
        key = _signature(args)
        failures = []  # per cached plan of these inputs, the guard that failed (newest first)
        if key == self._key:
            failed = self._compiled.guards.failing()
            if failed is None:
                return
            _check_replaceable(self, failed)
            failures.append(failed)
        entries = self._plans_by_shape.setdefault(key, [])
        for entry in reversed(entries):
            if entry[0] is self._compiled:
                continue
            failed = entry[0].guards.failing()
            if failed is None:
                self._use(key, entry)
                return
            _check_replaceable(self, failed)
            failures.append(failed)
        why = self._why_compile(failures)
        with self._state.global_shapes():  # split parameters hold shards by now
            compiled = self._trace_and_compile(args, len(self._compiled.plans))  # a plan per rank
        _check_input_placements(compiled, args)
        _check_same_stages(self._compiled, compiled)
        object.__setattr__(self, "_compiled", compiled)
        self._state.compiled = compiled
        self._setup_runtime(compiled, self._rank, new_state=False)
        entries.append((compiled, self._runtime, self._tracer))
        self._use(key, entries[-1])
        self.recompiles.append(why)
        if len(entries) == _PLANS_PER_SIGNATURE + 1:
            warn_user(f"{type(self).__name__} has compiled {len(entries)} plans for the same input "
                      f"shapes, the last because {why}. A value build() reads changes from call to "
                      "call, and every new value compiles a plan (slow). Fix: pass a changing "
                      "number as a tensor input, or keep it constant between calls.")

    def _use(self, key, entry) -> None:
        compiled, runtime, tracer = entry
        object.__setattr__(self, "_compiled", compiled)
        object.__setattr__(self, "_runtime", runtime)
        object.__setattr__(self, "_tracer", tracer)
        self._state.compiled = compiled
        object.__setattr__(self, "_key", key)

    def _why_compile(self, failures) -> str:
        """The recompile log's reason, as TORCH_LOGS=recompiles gives it: per cached plan of
        these input shapes, the first value that no longer matches."""
        reasons = []
        for failed in failures:
            path, was, now = difference(failed.expected, fingerprint(failed.read()))
            reason = f"{failed.where}{path} changed (compiled for {was}, now {now})"
            reasons += [reason] if reason not in reasons else []
        why = "; ".join(reasons) or "the inputs' shapes, dtypes or layouts are new"
        _log.info("recompiling %s: %s", type(self).__name__, why)
        return why

    def _setup_runtime(self, compiled: compiler.CompiledGraph, rank: int, new_state: bool = True) -> None:
        plan = compiled.plan_for(rank)
        local = plan.local_stages
        programs = {s: compiled.programs[s] for s in local}
        stage = compiled.stages[local[0]] if local else None
        device = device_for(stage.device_type) if stage else torch.device("cpu")
        if new_state:
            state = GraphState(self._root, compiled, rank, self._optimizer, self._lr_scheduler)
            state.take_ownership(device)
            object.__setattr__(self, "_state", state)
            if self._pending_state is not None:
                state.load(*self._pending_state)
                object.__setattr__(self, "_pending_state", None)
        self._agree(compiled, with_parameters=new_state)
        p2p = P2P(rank, compiled.plans)
        create_groups(compiled_groups(compiled))  # collective: every rank, same order
        tracer = Tracer.from_config(self.config, rank)
        object.__setattr__(self, "_tracer", tracer)
        object.__setattr__(self, "_runtime", Runtime(plan, programs, p2p, device, self._optimizer,
                                                     self._lr_scheduler, self.config.recv_window,
                                                     tracer.record))

    def _agree(self, compiled: compiler.CompiledGraph, with_parameters: bool) -> None:
        """Every rank runs the same plans from equal replicas (See NOTE: Rank agreement)."""
        facts = step_facts(compiled, self.config, self._state.steps)
        holders: Dict[str, List[int]] = {}
        if with_parameters:
            tensors = self._root.state_dict(keep_vars=True)
            split = getattr(self._state, "shards", {})
            for key in self._state.local_keys:
                if key in split or not isinstance(tensors[key], nn.Parameter):
                    continue
                facts["param:" + key] = fingerprint_tensor(tensors[key])
                holders[key] = sorted({r for s in self._state.holders[key]
                                       for r in compiled.stages[s].ranks})
        tag = f"{self._instance}/{sum(len(entries) for entries in self._plans_by_shape.values())}"
        check_agreement(facts, holders, f"the compiled {type(self).__name__}", tag, timeout_seconds())

    def _set_draw(self) -> None:
        """What random ops draw for this call: the agreed base seed and the step (a forward-only
        graph counts its calls), so a resumed run replays the same masks (NOTE: Replica-equal
        randomness, runtime/rng.py)."""
        step = self._state.steps if self._compiled.training else self._forward_calls
        self._runtime.set_draw(self._base_seed, step)

    def _check_inputs(self, args) -> None:
        want = self._compiled.input_meta
        if len(args) != len(want):
            raise GraphcError(f"{type(self).__name__} was compiled for {len(want)} inputs, "
                              f"called with {len(args)}")
        for i, ((local, (shape, _, _)), (w_shape, w_dtype)) in enumerate(zip(args, want)):
            if len(shape) != len(w_shape) or local.dtype.is_floating_point != w_dtype.is_floating_point:
                raise GraphcError(
                    f"input {i} of {type(self).__name__} has shape {list(shape)} and dtype "
                    f"{local.dtype}, but the graph was compiled for {list(w_shape)} {w_dtype}. "
                    "A new batch size, sequence length or precision compiles a second plan, but "
                    "the number of dimensions and the kind of dtype (floating or integer) are "
                    "part of the program. Fix: pass inputs of the same rank and kind, or build a "
                    "second Graph.")

    def _outputs(self, results: Dict[str, List[torch.Tensor]]):
        gm = self._compiled.gm
        out_node = gm.graph.output_node()

        def wrap(node: fx.Node):
            stage = self._compiled.stages[node.meta[META_STAGE]]
            sig = node.meta.get(META_SBP)
            mesh = sig.mesh if sig else tuple(stage.ranks)
            where = Placement(stage.device_type, [list(r) if isinstance(r, tuple) else r for r in mesh])
            sbp = sig.out if sig else (_broadcast(),)
            if node.name not in results:
                return GlobalTensor(torch.empty(0), where, sbp, ())
            return global_from_local(_merge(results[node.name], node.meta.get(META_ROWS)), where, sbp,
                                     _uneven_global_shape(node, self._compiled.num_microbatches))

        return fx.node.map_arg(out_node.args[0], wrap)

    # -- state -----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's part of a checkpoint, ready for torch.distributed.checkpoint (DCP).

        Parameters and buffers under the user's names (split ones as DTensors with their global
        shape), optimizer state by parameter name, LR scheduler, step count and RNG state (See
        NOTE: DCP state dict, graphc/dcp.py). DCP reshards it to any world size or layout;
        graphc.save keeps it as one file per rank, for the same layout.

        Returns:
            {"format", "model", "optim", "optimizer_class", "lr_scheduler", "steps", "rng"}

        Example:
            dcp.save(graph.state_dict(), checkpoint_id="ckpt/step100")
            # later, in any layout:
            graph.compile(x, y); sd = graph.state_dict()
            dcp.load(sd, checkpoint_id="ckpt/step100"); graph.load_state_dict(sd)
        """
        if self._state is None:
            raise GraphcError("state_dict() needs a compiled graph: run one step or call "
                              "graph.compile(*inputs) first")
        return dcp_state_dict(self._state, self._base_seed)

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        """Loads a graph.state_dict(); before compiling, it is applied at compile.

        Args:
            state: the dict graph.state_dict() returned, filled by dcp.load (any layout), or
                graphc.load(f"ckpt/rank{rank}.pt") of the file this rank saved.
            strict: as in torch: unknown entries, names the model does not have, and
                parameters or optimizer state this rank holds but `state` lacks, are errors;
                with False they are skipped.

        Example:
            sd = graph.state_dict(); dcp.load(sd, checkpoint_id=d); graph.load_state_dict(sd)
        """
        if not isinstance(strict, bool):
            raise GraphcError(f"load_state_dict: strict must be True or False, found {strict!r}")
        check_state_dict(state)  # the structure now; keys and shapes once compiled
        if self._state is None:
            object.__setattr__(self, "_pending_state", (state, strict))
            return
        self._state.load(state, strict)
        if self._state.base_seed is not None:  # the saved run's random ops (runtime/rng.py)
            object.__setattr__(self, "_base_seed", self._state.base_seed)

    def full_state_dict(self, rank0_only: bool = False, cpu_offload: bool = True) -> Dict[str, torch.Tensor]:
        """Collective: the complete model state dict, loadable into the eager model.

        Args:
            rank0_only: only rank 0 receives it (each tensor sent once, from one holder) and
                every other rank gets {}; by default every rank gets it.
            cpu_offload: the tensors returned are on the CPU (else on this rank's device).

        Example:
            full = graph.full_state_dict(rank0_only=True)
            if rank == 0: torch.save(full, "model.pt")
        """
        if self._state is None:
            return _unprefixed(self._root, {k: v.detach().clone() for k, v in self._root.state_dict().items()})
        return _unprefixed(self._root, self._state.full_state_dict(rank0_only, cpu_offload))

    def __repr__(self) -> str:
        name = type(self).__name__
        if self._compiled is None:
            mods = ", ".join(f"{k}: {type(v).__name__}" for k, v in self._root._modules.items())
            return f"{name}(not compiled; modules: {mods})"
        notes = "".join(f"\n# {note}" for note in self.plan.notes.values())  # e.g. stages found
        parts = [f"{name} (compiled){notes}"] + [str(p) for p in self._compiled.programs] + [str(self.plan)]
        return "\n\n".join(parts)


def _source_file(cls: type):
    """The file defining the Graph class, for error messages pointing into it (None when
    Python knows none: a built-in, or a class typed at the interpreter)."""
    try:
        return inspect.getsourcefile(cls)
    except (TypeError, OSError):
        return None


def _named_placements(graph: Graph, args) -> list:
    """(who, placement) for every placement the program names: set_stage, to_global on
    parameters and buffers, GlobalTensor inputs."""
    named = [(f"module '{name}'", c.placement) for name, c in graph._module_configs.items()
             if c.placement is not None]
    for key, t in graph._root.state_dict(keep_vars=True).items():
        layout = declared_layout(t)
        named += [(f"parameter or buffer '{key}'", layout[0])] if layout else []
    named += [(f"input {i}", where) for i, (_, (_, _, where)) in enumerate(args) if where is not None]
    return named


def _check_cuda_available(graph: Graph, args) -> None:
    """A "cuda" placement needs a CUDA device on this machine (graphc plan needs none)."""
    if torch.cuda.is_available():
        return
    for who, where in _named_placements(graph, args):
        if where.type == "cuda":
            raise GraphcError(
                f"{who} is placed on {where}, but this machine has no CUDA device "
                f"(torch.cuda.is_available() is False); a \"cuda\" placement needs one GPU per "
                f"rank. Fix: use graphc.placement(\"cpu\", ranks={_ranks_repr(where)}), or run on "
                "a machine with GPUs.")


def _ranks_repr(where: Placement) -> list:
    return [list(r) if isinstance(r, tuple) else r for r in where.ranks]


def _check_optimizer(optimizer: torch.optim.Optimizer, lr_sch) -> None:
    """What the runtime's once-per-call opt.step() and lr_sch.step() cannot drive."""
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.LBFGS):
        raise GraphcError(
            f"add_optimizer: {name} needs a closure (step(closure) re-evaluates the loss several "
            "times per step), but graphc calls optimizer.step() once per call with the "
            "accumulated gradients. Fix: use an optimizer whose step() takes no closure "
            "(SGD, Adam, AdamW, ...).")
    if lr_sch is None:
        return
    sch = type(lr_sch).__name__
    if isinstance(lr_sch, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise GraphcError(
            f"add_optimizer: lr_sch is a {sch}, whose step(metric) needs a metric (e.g. the "
            "validation loss) that graphc does not have when it steps the scheduler once per "
            "call. Fix: leave lr_sch out and call lr_sch.step(metric) yourself after the graph's "
            "call (or after each epoch), or pass a scheduler without a metric (StepLR, "
            "CosineAnnealingLR, LambdaLR, ...).")
    if not isinstance(lr_sch, torch.optim.lr_scheduler.LRScheduler):
        raise GraphcError(
            f"add_optimizer: lr_sch must be a torch.optim.lr_scheduler.LRScheduler, found {sch}. "
            "Fix: pass a scheduler built on this optimizer, e.g. "
            "lr_sch=torch.optim.lr_scheduler.StepLR(opt, step_size=10), or leave it out.")
    if getattr(lr_sch, "optimizer", optimizer) is not optimizer:
        raise GraphcError(
            f"add_optimizer: lr_sch ({sch}) was built on another optimizer "
            f"({type(lr_sch.optimizer).__name__}) than the {name} given, so stepping it would "
            "not change this optimizer's learning rate. Fix: build the scheduler on the "
            "optimizer you pass to add_optimizer.")


def _signature(args) -> tuple:
    """The input part of what a plan is specialised to: shapes, dtypes, layouts."""
    return tuple((tuple(shape), local.dtype, sbp, where) for local, (shape, sbp, where) in args)


def _check_replaceable(graph: Graph, failed) -> None:
    """A module, parameter or buffer replaced after compile cannot get a plan of its own."""
    if failed.replaceable:
        return
    now = failed.read()
    what = "removed" if now is MISSING else f"replaced by another {type(now).__name__}"
    raise GraphcError(
        f"'{failed.where}' of {type(graph).__name__} was {what} after the graph compiled. The "
        "graph's optimizer, gradient buckets and parameter shards hold the objects it was "
        "compiled with, so the new one would not be trained as eager trains it. Fix: build a "
        "new Graph (and optimizer) for the changed model, or copy new values into the existing "
        "parameters in place (with torch.no_grad(): p.copy_(new)).")


def _check_same_stages(old, new) -> None:
    if [(s.stage_id, tuple(s.ranks)) for s in old.stages] != [(s.stage_id, tuple(s.ranks)) for s in new.stages]:
        raise GraphcError(
            "a new input shape or Graph attribute changed the graph's pipeline stages "
            f"({[tuple(s.ranks) for s in old.stages]} -> {[tuple(s.ranks) for s in new.stages]}); "
            "the parameters already live on the first plan's ranks. Fix: set stages with set_stage "
            "so they do not depend on shapes, or build a second Graph.")


def _broadcast():
    from .placement import sbp
    return sbp.broadcast


def _uneven_global_shape(node: fx.Node, m: int):
    """The global shape of an output split unevenly (its local shape differs by rank, so it
    does not tell the global one); None for any other output. Micro-batches concatenate
    along the dim _merge joins them on."""
    sig, meta = node.meta.get(META_SBP), node.meta.get(META_TENSOR)
    if sig is None or meta is None or is_even(meta.shape, sig.out, sig.mesh):
        return None
    shape, rows = list(meta.shape), node.meta.get(META_ROWS)
    joined = rows.dim if rows is not None else (0 if shape else None)
    if m > 1 and joined is not None:
        shape[joined] *= m
    return tuple(shape)


def _merge(per_mb: List[torch.Tensor], rows=None) -> torch.Tensor:
    """One output from its micro-batches' values: concatenated along the batch's rows, a
    mean of a batch mean, a sum of a batch sum, or (no batch dim) the value every
    micro-batch computed alike."""
    if len(per_mb) == 1:
        return per_mb[0]
    if rows is not None and rows.dim is not None:
        return torch.cat(per_mb, rows.dim)
    if rows is not None and not rows.reduced:
        return per_mb[0]
    if rows is not None and rows.summed:  # a batch sum is the sum of its micro-batches' (NOTE: Batch sums)
        return torch.stack(per_mb).sum(0)
    if per_mb[0].dim() == 0 or rows is not None:
        return torch.stack(per_mb).mean(0)
    return torch.cat(per_mb, 0)


def _local_and_global(inputs) -> list:
    """[(local tensor, (global shape, sbp or None, placement or None))] for each input."""
    out = []
    for i, x in enumerate(inputs):
        if isinstance(x, GlobalTensor):
            out.append((x.to_local(), (tuple(x.shape), x.sbp, x.placement)))
        elif isinstance(x, torch.Tensor):
            out.append((x, (tuple(x.shape), None, None)))
        else:
            raise GraphcError(f"input {i} of the graph is a {type(x).__name__}; graph inputs must be "
                              "tensors or graphc.GlobalTensor. Fix: pass constants as module "
                              "attributes or Graph attributes instead.")
    return out


def _compile_inputs(args):
    """compiler.compile's example inputs (empty, of the global shapes) and input layouts
    (per input, None or a GlobalTensor's (placement, sbp)) for _local_and_global's args."""
    example = [torch.empty(g_shape, dtype=local.dtype) for local, (g_shape, _, _) in args]
    layouts = [(where, sbp) if sbp is not None else None for _, (_, sbp, where) in args]
    return example, layouts


def _check_input_placements(compiled, args) -> None:
    placeholders = [n for n in compiled.gm.graph.nodes if n.op == "placeholder"]
    for node, (_, (_, _, where)) in zip(placeholders, args):
        if where is None:
            continue
        stage = compiled.stages[node.meta[META_STAGE]]
        outside = [r for r in stage.ranks if r not in where.flat_ranks]
        if outside:
            raise GraphcError(
                f"input '{node.name}' is placed on {where} but is first used on stage "
                f"{stage.stage_id}, which runs on ranks {list(stage.ranks)}. Fix: create it with "
                f"graphc.to_global(t, placement=graphc.placement(\"{stage.device_type}\", "
                f"ranks={list(stage.ranks)}), sbp=graphc.sbp.broadcast).")


def _unprefixed(root: nn.Module, sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Drops the attribute prefix when a single assigned module holds all the state."""
    prefix = user_prefix(root)
    return {k[len(prefix):]: v for k, v in sd.items()}
