"""One compiled specialisation of a Graph: for one input signature and one set of guarded
values (STYLE 17; thunder keeps a cache entry per input signature, torch.compile a guarded
entry per guard set).

An Executable is built from values, never from the Graph: the CompileSpec, the calls'
InputSpecs and the world. Its life: `compile` (trace, passes, plans, and the guards of every
Python value the compile read: NOTE: Guards), `start` (this rank's transport, groups and
runtime; a compile without start is plan mode), `check` (the guards, on every call), `call`
(one step, outputs merged over micro-batches). A Graph's ExecutableCache
(graphc/executable_cache.py) holds them and the state every executable of it shares.
"""
from __future__ import annotations

import inspect
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from . import compiler, env
from .errors import GraphcError
from .global_tensor import GlobalTensor, declared_layout, global_from_local
from .guards import (Guard, GuardSet, first_call_differs, global_guards, hook_guards, record_reads,
                     refuse_traced_values_kept, requires_grad_guard, settle_own_writes, structure_of)
from .meta import META_OUTPUT_TREE, META_ROWS, META_SBP, META_STAGE, META_TENSOR
from .passes.trace_build import forward_replaced
from .placement import Layout, PartialSum
from .placement import placement as Placement
from .ops.conversions import compiled_groups, create_groups, from_every_rank
from .runtime.actors import Runtime
from .runtime.comm import P2P
from .runtime.cuda_graphs import capture_blockers
from .runtime.dist_env import device_for
from .runtime.master_params import stored_in
from .runtime.options import RunOptions
from .runtime.trace import Tracer
from .runtime.watchdog import run_step
from .sbp.layout import is_even



@dataclass(frozen=True)
class InputSpec:
    """One input of a call: this rank's local component, and the global value it is part of
    (shape; sbp and placement for a GlobalTensor, None for a plain tensor: broadcast, placed
    where its first reader runs)."""

    local: torch.Tensor
    shape: Tuple[int, ...]
    sbp: Optional[tuple] = None
    placement: Optional[Placement] = None

    @staticmethod
    def of(x, index: int) -> "InputSpec":
        if isinstance(x, GlobalTensor):
            return InputSpec(x.to_local(), tuple(x.shape), x.sbp, x.placement)
        if isinstance(x, torch.Tensor):
            return InputSpec(x, tuple(x.shape))
        raise GraphcError(f"input {index} of the graph is a {type(x).__name__}; graph inputs must be "
                          "tensors or graphc.GlobalTensor. Fix: pass constants as module "
                          "attributes or Graph attributes instead.")

    @property
    def layout(self) -> Optional[Layout]:
        """The Layout of a GlobalTensor input, None for a plain tensor."""
        return Layout(self.placement, self.sbp) if self.sbp is not None else None

    @property
    def key(self) -> tuple:
        """What a plan is specialised to for this input: shape, dtype, layout."""
        return (self.shape, self.local.dtype, self.sbp, self.placement)

    def example(self) -> torch.Tensor:
        """An empty tensor of the global shape and dtype, for the compiler."""
        return torch.empty(self.shape, dtype=self.local.dtype)


def input_specs(inputs: Sequence[Any]) -> List[InputSpec]:
    return [InputSpec.of(x, i) for i, x in enumerate(inputs)]


@dataclass(frozen=True)
class InputTree:
    """build()'s arguments when they are not all tensors (NOTE: Input trees): the pytree
    spec of the call's arguments and a name per leaf (`batch_input_ids` for
    batch["input_ids"]), which become the traced graph's inputs."""

    spec: Any
    names: Tuple[str, ...]


def flatten_call(inputs: Sequence[Any], build) -> Tuple[List[InputSpec], Optional[InputTree]]:
    """NOTE: Input trees. A call whose arguments are tensors is passed as it is (tree None);
    nested dicts, lists and tuples (a Hugging Face batch) are flattened to their tensor
    leaves, each an input of the graph, and build() gets the structure back while tracing.
    The structure (the number of leaves and the tree, a dict's keys included) is part of the
    input signature: a batch with another key set (one with an attention_mask, one without)
    selects or compiles a plan of its own (ExecutableCache.same_structure)."""
    if all(isinstance(x, (torch.Tensor, GlobalTensor)) for x in inputs):
        return input_specs(inputs), None
    is_leaf = lambda x: isinstance(x, GlobalTensor)  # noqa: E731 - a GlobalTensor is one input
    paths, spec = pytree.tree_flatten_with_path(tuple(inputs), is_leaf=is_leaf)
    params = [p.name for p in list(inspect.signature(build).parameters.values())[1:]]
    names, specs = [], []
    for i, (path, leaf) in enumerate(paths):
        name = _leaf_name(path, params)
        if not isinstance(leaf, (torch.Tensor, GlobalTensor)):
            where = path[0].idx if len(path) == 1 else f"'{name}'"
            raise GraphcError(f"input {where} of the graph is a {type(leaf).__name__}; graph inputs must "
                              "be tensors or graphc.GlobalTensor, or dicts, lists and tuples of them. "
                              "Fix: pass constants as module attributes or Graph attributes instead.")
        names.append(name if name not in names else f"{name}_{i}")
        specs.append(InputSpec.of(leaf, i))
    return specs, InputTree(spec, tuple(names))


def _leaf_name(path, params: List[str]) -> str:
    """batch["input_ids"] -> 'batch_input_ids': an identifier for a leaf's key path."""
    parts = []
    for k, key in enumerate(path):
        value = getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))
        if k == 0 and isinstance(value, int) and value < len(params):
            value = params[value]
        parts.append(re.sub(r"\W", "_", str(value)))
    name = "_".join(parts) or "input"
    return name if name[0].isalpha() or name[0] == "_" else f"x_{name}"


@contextmanager
def traced_tree(root: torch.nn.Module, tree: Optional[InputTree]):
    """While compiling: the root's forward takes the leaves, by name, and calls build() with
    the structure rebuilt from them (NOTE: Input trees)."""
    if tree is None:
        yield
        return
    build = type(root).forward
    rebuild = pytree.tree_unflatten
    scope: Dict[str, Any] = {"build": build, "rebuild": rebuild, "spec": tree.spec}
    names = ", ".join(tree.names)
    src = (f"def forward(self, {names}):\n"
           f"    return build(self, *rebuild([{names}], spec))\n")
    exec(src, scope)  # noqa: S102 - a fixed-arity wrapper, names from the batch's keys
    with forward_replaced(type(root), scope["forward"]):
        yield


@contextmanager
def _as_traced(spec: compiler.CompileSpec, tree: Optional[InputTree]):
    """build() as compile and retrace trace it: taking the call's leaves (NOTE: Input trees),
    the parameters in the dtype they will be stored in (NOTE: Master parameters)."""
    with traced_tree(spec.root, tree), stored_in(spec.root, spec.param_dtype):
        yield


def plans_lowered(rank: int) -> Optional[List[int]]:
    """The ranks whose plans a running rank compiles: its own (NOTE: Plans of some ranks), or
    with GRAPHC_VERIFY_PLANS=world every rank's, verified together as `graphc plan` does."""
    return None if env.read("GRAPHC_VERIFY_PLANS") == "world" else [rank]


def signature(specs: Sequence[InputSpec]) -> tuple:
    return tuple(s.key for s in specs)


class Executable:
    """A compiled graph for one signature and guard set, and (once started) its runtime."""

    def __init__(self, compiled: compiler.CompiledGraph):
        self.compiled = compiled
        self.runtime: Optional[Runtime] = None
        self.tracer: Optional[Tracer] = None
        self.returned: Optional[Dict[fx.Node, Returned]] = None   # build()'s results (outputs)

    @classmethod
    def compile(cls, spec: compiler.CompileSpec, specs: Sequence[InputSpec], world: int,
                tree: Optional[InputTree] = None, ranks: Optional[Sequence[int]] = None) -> "Executable":
        """compiler.compile for these inputs' global shapes and layouts, with the guards of
        every Python value the compile read (NOTE: Guards). ranks: whose plans to lower (a
        rank its own: NOTE: Plans of some ranks); None: every rank's (graphc plan)."""
        before = global_guards()  # the modes the caller set, before tracing changes any
        with record_reads(spec.root) as reads, _as_traced(spec, tree):
            compiled = compiler.compile(spec, [s.example() for s in specs], world, [s.layout for s in specs],
                                        ranks=ranks)
        guards = GuardSet(tuple(before + structure_of(spec.root) + hook_guards(spec.root)
                                + [requires_grad_guard(spec.root)] + reads.guards()))
        refuse_traced_values_kept(spec.name, guards)
        if compiled.traces_differ is not None:   # NOTE: Writes of the first call
            first_call_differs(spec.name, guards, *compiled.traces_differ)
        compiled.guards = settle_own_writes(spec.name, guards, compiled.trace,   # NOTE: Writes of the first call
                                            lambda: cls._retraced(spec, specs, world, tree))
        check_input_placements(compiled, specs)
        return cls(compiled)

    @staticmethod
    def _retraced(spec: compiler.CompileSpec, specs: Sequence[InputSpec], world: int,
                  tree: Optional[InputTree]):
        """build() traced again for these inputs, as compile traced it (its TraceText)."""
        with _as_traced(spec, tree):
            return compiler.retrace(spec, [s.example() for s in specs], world, [s.layout for s in specs])

    def retrace(self, spec: compiler.CompileSpec, specs: Sequence[InputSpec], tree: Optional[InputTree],
                name: str) -> None:
        """GRAPHC_RETRACE=1 (NOTE: Retrace check): build() traced again for this call, under the
        contexts it was compiled in; a graph other than the plan's is a GraphcError naming the
        first node that differs, the value a guard should have seen."""
        now = self._retraced(spec, specs, self.compiled.world_size, tree)
        found = self.compiled.trace.first_difference(now) if self.compiled.trace is not None else None
        if found is not None:
            where, was, new = found
            raise GraphcError(
                f"GRAPHC_RETRACE: {name}.build() traced for this call differs from the plan in use, "
                f"whose guards all hold: a Python value build() reads changed where no guard sees "
                f"it. First difference at {where}\n  plan: {was}\n  now:  {new}\n"
                "Fix: pass the value as a tensor input or keep it constant between calls, and "
                "report the path to graphc (it is a missing guard).")

    def device(self, rank: int) -> torch.device:
        """Where this rank's stages run (the CPU on a rank without a stage)."""
        local = self.compiled.plan_for(rank).local_stages
        return device_for(self.compiled.stages[local[0]].device_type) if local else torch.device("cpu")

    def start(self, rank: int, optimizer, lr_scheduler, options: RunOptions, grad_scaler=None,
              masters=None) -> None:
        """This rank's transport, process groups (collective: every rank, same order) and
        runtime, run with `options` (the graph's settings as values). `masters`: the float32
        masters of set_param_dtype (NOTE: Master parameters)."""
        plan = self.compiled.plan_for(rank)
        programs = {s: self.compiled.programs[s] for s in plan.local_stages}
        if options.cuda_graphs:   # before any group is created: every rank refuses alike
            check_capturable(options.graph_name, self.compiled, optimizer is not None, grad_scaler)
        p2p = P2P(rank, self.compiled.plans, self.compiled.whole_world)
        create_groups(from_every_rank(compiled_groups(self.compiled), self.compiled.whole_world))
        self.tracer = Tracer.for_options(options, rank)
        self.runtime = Runtime(plan, programs, p2p, self.device(rank), optimizer, lr_scheduler,
                               options.recv_window, self.tracer.record, grad_scaler, masters,
                               cuda_graphs=options.cuda_graphs, memory_stats=options.memory_stats,
                               compile_stages=options.compile_stages)

    def check(self) -> Optional[Guard]:
        """The first guard that no longer holds (None: this executable may run)."""
        return self.compiled.guards.failing()

    def check_inputs(self, specs: Sequence[InputSpec], name: str) -> None:
        """What a second signature of the same input structure cannot change: the inputs'
        ranks and kinds (NOTE: Input trees)."""
        want = self.compiled.input_meta
        for i, (s, (w_shape, w_dtype)) in enumerate(zip(specs, want)):
            if len(s.shape) != len(w_shape) or s.local.dtype.is_floating_point != w_dtype.is_floating_point:
                raise GraphcError(
                    f"input {i} of {name} has shape {list(s.shape)} and dtype "
                    f"{s.local.dtype}, but the graph was compiled for {list(w_shape)} {w_dtype}. "
                    "A new batch size, sequence length or precision compiles a second plan, but "
                    "the number of dimensions and the kind of dtype (floating or integer) are "
                    "part of the program. Fix: pass inputs of the same rank and kind, or build a "
                    "second Graph.")

    def call(self, specs: Sequence[InputSpec], draw: Tuple[int, int]):
        """One step: (build()'s outputs as GlobalTensors, the step's stats)."""
        self.runtime.set_draw(*draw)
        results, stats = run_step(self.runtime.step, [s.local for s in specs])
        self.tracer.after_step(stats)
        return self.outputs(results), stats

    def outputs(self, results: Dict[str, List[torch.Tensor]]):
        """build()'s output structure, each tensor a GlobalTensor merged over micro-batches."""
        compiled = self.compiled
        if self.returned is None:   # where each result lives: fixed by the plan, found once
            self.returned = {node: Returned.of(node, compiled) for node in _output_nodes(compiled.gm)}
        returned = self.returned
        out = fx.node.map_arg(compiled.gm.graph.output_node().args[0], lambda node: returned[node].value(results))
        tree = compiled.gm.meta.get(META_OUTPUT_TREE)  # the user's own classes (NOTE: Output trees)
        return pytree.tree_unflatten(list(out), tree) if tree is not None else out


@dataclass(frozen=True)
class Returned:
    """One of build()'s results as a call returns it: its placement and sbp (a partial_sum
    summed by the plan), how micro-batches merge (its rows), and the global shape of an
    uneven split (None: the local shape tells it)."""

    name: str
    placement: Placement
    sbp: tuple
    rows: Any
    shape: Optional[Tuple[int, ...]]

    @staticmethod
    def of(node: fx.Node, compiled: compiler.CompiledGraph) -> "Returned":
        stage = compiled.stages[node.meta[META_STAGE]]
        sig = node.meta.get(META_SBP)
        mesh = sig.mesh if sig else tuple(stage.ranks)
        where = Placement(stage.device_type, [list(r) if isinstance(r, tuple) else r for r in mesh])
        sbp = _summed(sig.out) if sig else (_broadcast(),)   # partial_sum: the plan summed it
        return Returned(node.name, where, sbp, node.meta.get(META_ROWS),
                        _uneven_global_shape(node, compiled.num_microbatches))

    def value(self, results: Dict[str, List[torch.Tensor]]) -> GlobalTensor:
        """This call's GlobalTensor: the micro-batches' values merged (empty on a rank
        outside its placement)."""
        if self.name not in results:
            return GlobalTensor(torch.empty(0), self.placement, self.sbp, ())
        return global_from_local(merge(results[self.name], self.rows), self.placement, self.sbp, self.shape)


def _output_nodes(gm: fx.GraphModule) -> List[fx.Node]:
    nodes: List[fx.Node] = []
    fx.node.map_arg(gm.graph.output_node().args[0], nodes.append)
    return nodes


def check_same_stages(old: compiler.CompiledGraph, new: compiler.CompiledGraph) -> None:
    if [(s.stage_id, tuple(s.ranks)) for s in old.stages] != [(s.stage_id, tuple(s.ranks)) for s in new.stages]:
        raise GraphcError(
            "a new input shape or Graph attribute changed the graph's pipeline stages "
            f"({[tuple(s.ranks) for s in old.stages]} -> {[tuple(s.ranks) for s in new.stages]}); "
            "the parameters already live on the first plan's ranks. Fix: set stages with set_stage "
            "so they do not depend on shapes, or build a second Graph.")


def check_capturable(name: str, compiled: compiler.CompiledGraph, has_optimizer: bool, grad_scaler) -> None:
    """config.set_cuda_graphs(True) on a graph whose steps can be captured (NOTE: CUDA graphs)."""
    why = capture_blockers(compiled.plans, compiled.stages, compiled.programs, has_optimizer, grad_scaler)
    if why:
        lines = "\n".join(f"  - {w}" for w in why)
        raise GraphcError(f"{name}: config.set_cuda_graphs(True) cannot capture this graph's "
                          f"step:\n{lines}\nCUDA graphs replay a fixed sequence of CUDA kernels; "
                          "anything the host decides or reads during a step cannot be replayed "
                          "(NOTE: CUDA graphs, graphc/runtime/cuda_graphs.py).")


def check_input_placements(compiled: compiler.CompiledGraph, specs: Sequence[InputSpec]) -> None:
    placeholders = [n for n in compiled.gm.graph.nodes if n.op == "placeholder"]
    for node, s in zip(placeholders, specs):
        if s.placement is None:
            continue
        stage = compiled.stages[node.meta[META_STAGE]]
        outside = [r for r in stage.ranks if r not in s.placement.flat_ranks]
        if outside:
            raise GraphcError(
                f"input '{node.name}' is placed on {s.placement} but is first used on stage "
                f"{stage.stage_id}, which runs on ranks {list(stage.ranks)}. Fix: create it with "
                f"graphc.to_global(t, placement=graphc.placement(\"{stage.device_type}\", "
                f"ranks={list(stage.ranks)}), sbp=graphc.sbp.broadcast).")


def named_placements(spec: compiler.CompileSpec, specs: Sequence[InputSpec]) -> list:
    """(who, placement) for every placement the program names: set_stage, to_global on
    parameters and buffers, GlobalTensor inputs."""
    named = [(f"module '{name}'", c.placement) for name, c in spec.modules.items()
             if c.placement is not None]
    for key, t in spec.root.state_dict(keep_vars=True).items():
        layout = spec.declared.of(key) or declared_layout(t)
        named += [(f"parameter or buffer '{key}'", layout.placement)] if layout else []
    named += [(f"input {i}", s.placement) for i, s in enumerate(specs) if s.placement is not None]
    return named


def check_cuda_available(spec: compiler.CompileSpec, specs: Sequence[InputSpec]) -> None:
    """A "cuda" placement needs a CUDA device on this machine (graphc plan needs none)."""
    if torch.cuda.is_available():
        return
    for who, where in named_placements(spec, specs):
        if where.type == "cuda":
            raise GraphcError(
                f"{who} is placed on {where}, but this machine has no CUDA device "
                f"(torch.cuda.is_available() is False); a \"cuda\" placement needs one GPU per "
                f"rank. Fix: use graphc.placement(\"cpu\", ranks={_ranks_repr(where)}), or run on "
                "a machine with GPUs.")


def _summed(sbp: tuple) -> tuple:
    """A result's layout once its OutputAllReduce ran: partial_sum axes broadcast."""
    return tuple(_broadcast() if isinstance(s, PartialSum) else s for s in sbp)


def _ranks_repr(where: Placement) -> list:
    return [list(r) if isinstance(r, tuple) else r for r in where.ranks]


def _broadcast():
    from .placement import sbp
    return sbp.broadcast


def _uneven_global_shape(node: fx.Node, m: int):
    """The global shape of an output split unevenly (its local shape differs by rank, so it
    does not tell the global one); None for any other output. Micro-batches concatenate
    along the dim merge joins them on."""
    sig, meta = node.meta.get(META_SBP), node.meta.get(META_TENSOR)
    if sig is None or meta is None or is_even(meta.shape, sig.out, sig.mesh):
        return None
    shape, rows = list(meta.shape), node.meta.get(META_ROWS)
    joined = rows.dim if rows is not None else (0 if shape else None)
    if m > 1 and joined is not None:
        shape[joined] *= m
    return tuple(shape)


def merge(per_mb: List[torch.Tensor], rows=None) -> torch.Tensor:
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
        return torch.stack(per_mb).sum(0, dtype=per_mb[0].dtype)  # an int32 count stays one
    if per_mb[0].dim() == 0 or rows is not None:
        return torch.stack(per_mb).mean(0)
    return torch.cat(per_mb, 0)
