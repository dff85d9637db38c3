"""graphc.Graph: the user's entry point (see README.md, "The API by example")."""
from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.nn as nn

from . import compiler, world
from .amp import checked_scaler
from .auto.inputs import laid_out
from .block import ModuleBlock
from .build_root import BuildRoot
from .checking.every_step import StepChecks
from .config import GraphConfig
from .errors import GraphcError
from .executable import flatten_call
from .executable_cache import ExecutableCache
from .checking.optimizer import check_optimizer
from .plan.plan import ExecutionPlan
from .runtime.zero_access import graph_entry
from .checkpoint.graph_state import check_state_dict

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
        object.__setattr__(self, "last_stats", None)
        # per input signature (shapes, dtypes, layouts), one Executable per set of guarded
        # values (NOTE: Guards), and the state they share; the current one gives _compiled and _runtime
        object.__setattr__(self, "_cache", ExecutableCache(self))
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
        return self._cache.spec()  # what compiler.compile reads of this Graph, taken now

    def compile(self, *inputs) -> ExecutionPlan:
        """Compiles for these example inputs without running a step; returns this rank's plan."""
        if self._compiled is None:
            with self._entry():
                self._cache.compile_first(*flatten_call(laid_out(self, inputs), type(self).build))
        return self.plan

    def _entry(self):
        """Around each public call that may read or write the model's parameters: ZeRO stage 3's
        are refused to reads between calls (NOTE: ZeRO-3 parameters between calls)."""
        return graph_entry(self._root.parameters)

    def __call__(self, *inputs):
        with self._entry():
            return self._step(*inputs)

    def _step(self, *inputs):
        inputs = laid_out(self, inputs)  # under load_layout: this rank's rows (NOTE: Auto layouts)
        specs, tree = flatten_call(inputs, type(self).build)  # NOTE: Input trees
        checks = StepChecks.before_call(self)  # against eager (NOTE: Checked first step, Checked steps)
        exe = self._cache.executable_for(specs, tree)   # looked up, or compiled, agreed and started
        checks.start(inputs)
        outputs, stats = exe.call(specs, self._cache.draw())
        object.__setattr__(self, "last_stats", stats)
        self._cache.count_step()
        checks.compare(outputs)
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

    # the current executable's compiled graph and runtime (None before the first compile), and
    # what every executable of the graph shares (executable_cache.py)
    _compiled = property(lambda self: getattr(self.__dict__["_cache"].current, "compiled", None))
    _runtime = property(lambda self: getattr(self.__dict__["_cache"].current, "runtime", None))
    _state = property(lambda self: self.__dict__["_cache"].state)
    _rank = property(lambda self: self.__dict__["_cache"].rank)

    @property
    def recompiles(self) -> List[str]:
        """Why each plan after the first was compiled (NOTE: Guards), oldest first."""
        return self._cache.recompiles

    # -- state -----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's part of a checkpoint, ready for torch.distributed.checkpoint (DCP).

        Parameters and buffers under the user's names (split ones as DTensors with their global
        shape), optimizer state by parameter name, LR scheduler, step count and RNG state (See
        NOTE: DCP state dict, graphc/checkpoint/dcp.py). DCP reshards it to any world size or layout;
        graphc.save keeps it as one file per rank, for the same layout.

        Returns:
            {"format", "model", "optim", "optimizer_class", "lr_scheduler", "steps", "rng"}

        Example:
            dcp.save(graph.state_dict(), checkpoint_id="ckpt/step100")
            # later, in any layout:
            graph.compile(x, y); sd = graph.state_dict()
            dcp.load(sd, checkpoint_id="ckpt/step100"); graph.load_state_dict(sd)
        """
        with self._entry():
            sd = self._cache.state_dict()
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
        with self._entry():
            self._cache.load_state_dict(state, strict)

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
        with self._entry():
            return self._cache.full_state_dict(rank0_only, cpu_offload)

    def __repr__(self) -> str:
        name = type(self).__name__
        if self._compiled is None:
            mods = ", ".join(f"{k}: {type(v).__name__}" for k, v in self._root._modules.items())
            return f"{name}(not compiled; modules: {mods})"
        notes = "".join(f"\n# {note}" for note in self.plan.notes.values())  # e.g. stages found
        parts = [f"{name} (compiled){notes}"] + [str(p) for p in self._compiled.programs] + [str(self.plan)]
        return "\n\n".join(parts)
