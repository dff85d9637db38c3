"""graphc.Graph: the user's entry point (see README.md, "The API by example")."""
from __future__ import annotations

import inspect
import os
from contextlib import contextmanager
from typing import Any, Dict, List

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from . import check_mode, compiler, env, plan_mode, world
from .amp import checked_scaler
from .block import ModuleBlock
from .build_root import BuildRoot
from .check_mode import CheckDone
from .check_step import FirstStepCheck, optimizer_groups, warn_if_random
from .checked_steps import StepChecker
from .auto.layout import apply_layout, batch_layouts, batched_inputs, input_stages, named_searcher
from .config import GraphConfig
from .dcp import dcp_state_dict, unprefixed
from .errors import GraphcError
from .executable import (Executable, ExecutableCache, _as_traced, check_cuda_available, check_same_stages,
                         flatten_call, named_placements, plans_lowered, signature)
from .global_tensor import GlobalTensor, to_global
from .graph_spec import compile_spec
from .optim_check import check_optimizer
from .plan.plan import ExecutionPlan
from .runtime.dist_env import ensure_process_group, timeout_seconds
from .runtime.rng import agree_base_seed
from .runtime.zero import whole_parameters
from .state import GraphState, check_state_dict

_CREATED: Dict[tuple, int] = {}  # (Graph subclass name, process) -> instances created


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
        root_cls = type(f"{type(self).__name__}Build", (BuildRoot,), {"forward": type(self).build})
        root = root_cls()
        object.__setattr__(root, "_graphc_graph", self)
        object.__setattr__(self, "_root", root)
        object.__setattr__(self, "_module_configs", {})
        object.__setattr__(self, "config", GraphConfig(self))
        object.__setattr__(self, "_optimizer", None)
        object.__setattr__(self, "_lr_scheduler", None)
        object.__setattr__(self, "grad_scaler", None)  # graphc.amp.GradScaler (set_grad_scaler)
        object.__setattr__(self, "_state", None)
        object.__setattr__(self, "_pending_state", None)
        object.__setattr__(self, "_rank", 0)
        object.__setattr__(self, "last_stats", None)
        # per input signature (shapes, dtypes, layouts), one Executable per set of guarded
        # values (NOTE: Guards); the current one gives _compiled and _runtime
        object.__setattr__(self, "_cache", ExecutableCache(type(self).__name__))
        object.__setattr__(self, "_base_seed", 0)  # rank 0's torch.initial_seed(), agreed at compile
        object.__setattr__(self, "_forward_calls", 0)
        object.__setattr__(self, "_checker", None)  # check mode's eager comparison (NOTE: Checked steps)
        object.__setattr__(self, "_input_layouts", None)  # under load_layout: each input's (NOTE: Auto layouts)
        # this graph's name in rank agreement: class and creation order, the same on every rank
        # (per process: each rank of a local world counts its own, NOTE: Local world)
        counter = (type(self).__name__, getattr(world.current(), "process_key", None))
        _CREATED[counter] = _CREATED.get(counter, 0) + 1
        object.__setattr__(self, "_instance", f"{type(self).__name__}-{_CREATED[counter]}")

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
        check_optimizer(optimizer, lr_sch)
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_lr_scheduler", lr_sch)

    def set_grad_scaler(self, scaler) -> None:
        """Loss scaling for float16 (OneFlow's name; NOTE: Loss scaling, graphc/amp.py).

        Example:
            self.config.enable_amp(True, dtype=torch.float16)
            self.set_grad_scaler(graphc.amp.GradScaler(init_scale=2.0**16))
        """
        object.__setattr__(self, "grad_scaler", checked_scaler(scaler, compiled=self._compiled is not None))

    # -- compile and run -------------------------------------------------------------
    def _compile_spec(self) -> compiler.CompileSpec:
        spec = compile_spec(self)  # what compiler.compile reads of this Graph, taken now
        layout = self.config.layout   # load_layout, or what graphc plan --auto chose
        return spec if layout is None else apply_layout(spec, layout)

    def compile(self, *inputs) -> ExecutionPlan:
        """Compiles for these example inputs without running a step; returns this rank's plan."""
        if self._compiled is None:
            self._compile(*flatten_call(self._laid_out(inputs), type(self).build))
        return self.plan

    def __call__(self, *inputs):
        inputs = self._laid_out(inputs)  # under load_layout: this rank's rows (NOTE: Auto layouts)
        specs, tree = flatten_call(inputs, type(self).build)  # NOTE: Input trees
        check = None
        checking = check_mode.active()  # graphc check: every call against eager (NOTE: Checked steps)
        if self._compiled is None:
            if self.config.check_microbatching:  # NOTE: Checked first step
                check = FirstStepCheck(self, optimizer_groups(self))
            if checking is not None and self._checker is None:
                object.__setattr__(self, "_checker", StepChecker(self, optimizer_groups(self), checking.bound))
            self._compile(specs, tree)
        elif self._runtime is not None:  # (plan mode has no runtime: it stops just below)
            self._compiled_for(specs, tree)
        if self._runtime is None:  # plan mode (graphc plan): plans written, no training
            plan_mode.stop_before_step(self)
        check = check if check is not None and not warn_if_random(self._compiled) else None
        if check is not None:
            check.start(inputs)
        checker = self._checker if checking is not None else None
        if checker is not None:
            checker.start(inputs)
            if checker.report not in checking.reports and self._rank == 0:
                checking.reports.append(checker.report)
        training = self._compiled.training
        step = self._state.steps if training else self._forward_calls
        # random ops draw by the agreed base seed and the step (a forward-only graph counts its
        # calls), so a resumed run replays the same masks (NOTE: Replica-equal randomness)
        outputs, stats = self._cache.current.call(specs, (self._base_seed, step))
        object.__setattr__(self, "last_stats", stats)
        self._state.steps += 1 if training else 0
        object.__setattr__(self, "_forward_calls", self._forward_calls + (0 if training else 1))
        if check is not None:
            check.compare(outputs)
        if checker is not None:
            checker.compare(outputs)
            if checking.steps is not None and len(checker.report.rows) >= checking.steps:
                raise CheckDone(f"{type(self).__name__}: {len(checker.report.rows)} step(s) checked")
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

    # the current executable's compiled graph and runtime (None before the first compile)
    _compiled = property(lambda self: getattr(self.__dict__["_cache"].current, "compiled", None))
    _runtime = property(lambda self: getattr(self.__dict__["_cache"].current, "runtime", None))

    @property
    def recompiles(self) -> List[str]:
        """Why each plan after the first was compiled (NOTE: Guards), oldest first."""
        return self._cache.recompiles

    def _compile(self, specs, tree=None) -> None:
        mode = plan_mode.active()
        if mode is not None and mode.auto is not None and self.config.layout is None:
            # graphc plan --auto: the tools search a layout, compile it; written as any plan
            self.config.layout, compiled = mode.auto(self, compile_spec(self), specs, tree, mode)
            mode.write_graph(self, compiled)
            self._cache.add((signature(specs), tree), Executable(compiled))
            return
        if mode is not None:  # graphc plan: compile for N ranks here, write, no process group
            exe = Executable.compile(self._compile_spec(), specs, mode.nproc, tree)
            mode.write_graph(self, exe.compiled)  # the tools' writer (See NOTE: Plan-mode writer)
            self._cache.add((signature(specs), tree), exe)
            return
        spec = self._compile_spec()
        check_cuda_available(spec, specs)  # before torch's own AssertionError, on every rank
        device_types = {where.type for _, where in named_placements(spec, specs)}  # set_stage or not
        rank, world = ensure_process_group(device_types or {"cpu"})
        # a model another graph holds as ZeRO stage 3 shards is traced and agreed on whole
        with whole_parameters(self._root.parameters()):
            exe = Executable.compile(spec, specs, world, tree, ranks=plans_lowered(rank))
            object.__setattr__(self, "_rank", rank)
            self._start(exe, new_state=True)
        self._cache.add((signature(specs), tree), exe)
        # after a pending checkpoint is loaded: it names the run's base seed (or its RNG state,
        # from older graphc, carries the run's initial seed)
        seed = agree_base_seed(self._instance, timeout_seconds())
        object.__setattr__(self, "_base_seed", seed if self._state.base_seed is None else self._state.base_seed)

    def _compiled_for(self, specs, tree=None) -> None:
        """A new input shape or structure (NOTE: Input trees), or a Python value build() read
        that changed (NOTE: Guards), selects (or compiles and caches) another executable.

        Every rank calls the graph with the same program, so every rank changes plan at the
        same call (compiling is deterministic; new process groups are created collectively).
        """
        key = (signature(specs), tree)
        same = self._cache.same_structure(key)  # a new structure is a new program (NOTE: Input trees)
        if same is not None:
            same.check_inputs(specs, type(self).__name__)
        exe, failures = self._cache.lookup(key)
        if exe is None:
            with self._traceable():
                exe = Executable.compile(self._compile_spec(), specs, self._compiled.world_size, tree,
                                         ranks=plans_lowered(self._rank))
            check_same_stages(self._compiled, exe.compiled)
            self._state.adopt(exe.compiled, exe.device(self._rank))
            self._state.compiled = exe.compiled
            self._start(exe, new_state=False)
            self._cache.add(key, exe, failures)
        elif env.read("GRAPHC_RETRACE") == "1":   # the guards' oracle (NOTE: Retrace check)
            with self._traceable():
                exe.retrace(self._compile_spec(), specs, tree, type(self).__name__)
        self._cache.use(key, exe)
        self._state.compiled = exe.compiled

    def _laid_out(self, inputs):
        """Under config.load_layout with data parallelism, plain tensor inputs (the whole batch
        on every rank) become this rank's rows as GlobalTensors on the stage that reads each
        (NOTE: Auto layouts); inputs the user made global, or no layout, are left alone."""
        if self.config.auto is not None and self.config.layout is None:
            self.config.layout = self._searched_layout(inputs)   # NOTE: Run-time search
        layout = self.config.layout
        if layout is None or layout.dp == 1:
            return inputs
        leaves, treedef = pytree.tree_flatten(tuple(inputs), is_leaf=lambda x: isinstance(x, GlobalTensor))
        if any(isinstance(x, GlobalTensor) for x in leaves):
            return inputs
        if self._input_layouts is None:
            specs, tree = flatten_call(inputs, type(self).build)
            names = tree.names if tree is not None else \
                [p for p in list(inspect.signature(type(self).build).parameters)[1:]]
            batched = batched_inputs(leaves, names, self.config.whole_inputs)
            spec = compile_spec(self)
            with _as_traced(spec, tree):
                stages = input_stages(spec, [s.example() for s in specs], layout)
            object.__setattr__(self, "_input_layouts", batch_layouts(layout, leaves, batched, stages))
        # before the first compile makes the process group, torchrun's RANK names this rank
        rank = world.rank() if world.current() is not None else int(os.environ.get("RANK", "0"))
        return tuple(pytree.tree_unflatten(_local_rows(layout, rank, leaves, self._input_layouts), treedef))

    def _searched_layout(self, inputs):
        """The layout enable_auto_parallel asked for, the same on every rank: rank 0's, from
        the search cache or a search, broadcast (See NOTE: Run-time search)."""
        mode = plan_mode.active()
        if mode is not None and mode.auto is not None:
            return None          # graphc plan --auto searches with its own options
        specs, tree = flatten_call(inputs, type(self).build)
        spec = compile_spec(self)
        examples = [s.example() for s in specs]
        names = tree.names if tree is not None else list(inspect.signature(type(self).build).parameters)[1:]
        batched = batched_inputs(examples, names, spec.whole_inputs)
        rank, nproc = (0, mode.nproc) if mode is not None else ensure_process_group({"cpu"})

        def search():
            with _as_traced(spec, tree):
                return named_searcher()(spec, examples, nproc, batched, self._optimizer, self.config.auto)
        if mode is not None or world.current() is None:
            return search()
        if rank != 0:
            found = world.current().broadcast_object(None, 0)
        else:
            try:
                found = world.current().broadcast_object(search(), 0)
            except GraphcError as exc:   # the other ranks raise it too, not wait for a layout
                world.current().broadcast_object(str(exc), 0)
                raise
        if isinstance(found, str):
            raise GraphcError(f"rank {rank}: enable_auto_parallel: rank 0's search failed: {found}")
        return found

    @contextmanager
    def _traceable(self):
        """The parameters as a trace reads them after the first call: split ones hold shards
        by now (their global shapes stand in), ZeRO stage 3's are gathered."""
        with whole_parameters(self._root.parameters()), self._state.global_shapes():
            yield

    def _start(self, exe: Executable, new_state: bool) -> None:
        """The graph's state (the first time), rank agreement, then the executable's runtime."""
        if new_state:
            state = GraphState(self._root, exe.compiled, self._rank, self._optimizer, self._lr_scheduler,
                               self.config.param_dtype)
            state.take_ownership(exe.device(self._rank))
            object.__setattr__(self, "_state", state)
            if self._pending_state is not None:
                state.load(*self._pending_state)
                object.__setattr__(self, "_pending_state", None)
        # every rank runs the same plans from equal replicas (See NOTE: Rank agreement)
        self._state.agree(exe.compiled, self.config, f"the compiled {type(self).__name__}",
                          f"{self._instance}/{len(self._cache)}", with_parameters=new_state)
        exe.start(self._rank, self._optimizer, self._lr_scheduler, self.config, self.grad_scaler,
                  self._state.masters)

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
        with whole_parameters(self._root.parameters()):   # ZeRO stage 3's shards, gathered for the call (NOTE: ZeRO stage 3)
            sd = dcp_state_dict(self._state, self._base_seed)
        if self.grad_scaler is not None:  # the loss scale resumes where it was (graphc/amp.py)
            sd["grad_scaler"] = self.grad_scaler.state_dict()
        return sd

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
        if self.grad_scaler is not None and "grad_scaler" in state:  # graphc/amp.py
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        if self._state is None:
            object.__setattr__(self, "_pending_state", (state, strict))
            return
        with whole_parameters(self._root.parameters()):   # written whole, kept as ZeRO stage 3's rows (NOTE: ZeRO stage 3)
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
            return unprefixed(self._root, {k: v.detach().clone() for k, v in self._root.state_dict().items()})
        with whole_parameters(self._root.parameters()):   # ZeRO stage 3's shards (NOTE: ZeRO stage 3)
            return unprefixed(self._root, self._state.full_state_dict(rank0_only, cpu_offload))

    def __repr__(self) -> str:
        name = type(self).__name__
        if self._compiled is None:
            mods = ", ".join(f"{k}: {type(v).__name__}" for k, v in self._root._modules.items())
            return f"{name}(not compiled; modules: {mods})"
        notes = "".join(f"\n# {note}" for note in self.plan.notes.values())  # e.g. stages found
        parts = [f"{name} (compiled){notes}"] + [str(p) for p in self._compiled.programs] + [str(self.plan)]
        return "\n\n".join(parts)


def _local_rows(layout, rank: int, inputs, laid) -> list:
    """This rank's call arguments under a loaded layout (`laid`: batch_layouts'): each split
    input cut to the rows of the rank's data-parallel coordinate and made a GlobalTensor on its
    placement (a rank outside it passes the first coordinate's rows: they are not read)."""
    out = []
    for t, where in zip(inputs, laid):
        if where is None:
            out.append(t)
            continue
        ranks = list(where.placement.flat_ranks)
        row = ranks.index(rank) // layout.tp if rank in ranks else 0
        out.append(to_global(t.chunk(layout.dp)[row], placement=where.placement, sbp=where.sbp))
    return out
