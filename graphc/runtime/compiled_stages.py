"""config.set_compile_stages(True): each stage program's compute compiled with Inductor.

NOTE: Compiled stages
A stage program is an fx graph of static shapes, run once per micro-batch: the input
Inductor wants. `compile_program` cuts it into *pieces* and hands the executor a program
of the same interface (inputs, outputs, parameters) that runs them in order:

- compiled pieces: maximal runs of plain torch ops, each compiled by
  `torch._inductor.compile_fx.compile_fx` (what `torch.compile(backend="inductor")` calls
  after Dynamo). Through AOTAutograd that gives a forward and a backward kernel program
  per piece, joined to the rest of the stage by one autograd node, so the executor's own
  backward (whole, or after a recompute) runs the compiled backward unchanged. Under a
  split backward (zero-bubble schedules) the backward is two compiled parts instead, input
  and weight gradients (NOTE: Split compiled backward). Checkpointing recomputes inside the
  compiled backward (NOTE: Recompute in compiled pieces).
- eager pieces, run as traced: every graphc op (communication boxes, sends of tensor
  parallelism, the losses graphc writes, seeded random ops, set_autocast), random ops
  (Inductor draws other numbers than eager's generator), and a checkpointed module with
  buffers (its eager region restores them for the recompute).

Autocast regions compile: the region's set_autocast calls are graphc ops, so its ops form
their own pieces, each traced (at its first call) under the region's state, the casts in its
graph as in eager; its backward is traced outside autocast (`backward_pass_autocast="off"`),
as the executor runs eager's; and Inductor rounds each low-precision intermediate as eager
does (`emulate_precision_casts`; without it Inductor keeps fused intermediates in float32
and rounds once, as torch.compile does). Measured on a Linear-GELU-Linear-LayerNorm-Tanh
stack under bf16 autocast: the forward bitwise eager autocast's, gradients 3e-3 to 6e-3 of
their largest value away (torch.compile's: 2e-3 to 6e-3). Trained two steps (SkipNet, pp2,
2 micro-batches, Adam), against eager autocast on the whole batch: graphc compiled |dloss|
1.2e-7, |dparam| 9.3e-5; graphc uncompiled 1.2e-7, 4.1e-5 (the micro-batches' own bf16
cuts); torch.compile of the eager model 6.0e-4, 2.0e-2. The floor is measured, not derived:
the test holds graphc compiled to twice the larger of torch.compile's and uncompiled
graphc's distances (test_autocast_regions_compiled_as_torch_compile).

Why compile_fx and not torch.compile on the piece: Dynamo would trace again what fx has
already traced, and its guards would check every call what the plan has fixed. The one
thing a call may change is what AOTAutograd bakes into a compiled piece: grad mode, which
inputs need a gradient, whether it recomputes in its backward (a checkpointed micro-batch),
the autocast state, and the inputs' shapes and strides. Each piece
keeps one compiled variant per such key (`_variant_key`), built at the first call that
needs it and reused for every later call and step of the plan.

The numbers: a compiled piece computes the same ops in another order of floating-point
operations (fused loops, reductions vectorised), so it is not bitwise eager: in float64
the losses and parameters agree with eager to ~1e-15 relative, and the tests hold them to
the repository's 1e-10 (tests/runtime/test_compiled_stages.py).

Caching: Inductor's FX graph cache (on by default, under TORCHINDUCTOR_CACHE_DIR, default
/tmp/torchinductor_<user>) keys each compiled forward and backward by its AOT graph, its
inputs' shapes, dtypes and strides, and torch's and Inductor's configuration, so a second
process compiling the same plan loads the kernels from disk instead of generating and
building C++ (GPT, one stage: 29 s cold, 18 s cached, `fxgraph_cache_hit` 2). It needs a
ShapeEnv in the tracing context, which Dynamo would supply (`_inductor`). AOTAutograd's own
cache keys a piece by its graph's code, which recompute tags are not part of: it is off for
tagged pieces (it handed back the untagged piece's partition, measured). The compile time of
each stage is logged once per step that compiled, and kept in `StepStats.compile_seconds`.

What runs uncompiled, with a warning naming it and why: a piece Inductor fails on
(`CompiledPiece._compile`). ZeRO stage 3 compiles (`compile_stages`), gathered per stage or
per unit; measured equal to eager at 1e-10 with data parallel, pipeline x data parallel
(1F1B, ZBV, interleaved), units, and units with checkpointing
(test_zero_stage_3_compiled_equal_eager); gathered per unit, a checkpointed micro-batch keeps
the executor's recompute, whose gathers the plan lists. A piece the split export refuses (it
mutates an input) compiles whole under a split backward, with a warning: its parameters'
gradients are computed in I, and W only accumulates them.
"""
from __future__ import annotations

import operator
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List

import torch
import torch.fx as fx

from ..log import get_logger, warn_user
from ..ops.autocast import autocast_state
from ..ops.checkpointed_region import CheckpointedRegion
from ..ops.random_ops import RANDOM_FUNCTIONS, RANDOM_METHODS
from ..plan.instructions import BackwardInput
from ..plan.plan import ExecutionPlan
from .compiled_split import build_split
from .compiled_recompute import inline_checkpoints, recompute_variant, recomputing, tagged_for_recompute

_RANDOM_TARGETS = {id(fn) for fn in RANDOM_FUNCTIONS.values()}
_DROPOUT_MODULES = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                    torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)
# Inductor's compile reads and writes process-wide state (its virtualized graph, the
# tracing context): ranks of the local world (threads) compile one at a time
_COMPILE_LOCK = threading.Lock()
_LOG = get_logger("runtime")


@dataclass
class CompileRecord:
    """What compiling one stage's pieces took, and which nodes stayed eager."""

    stage: int
    pieces: int = 0
    eager: Dict[str, int] = field(default_factory=dict)   # nodes run as traced, by why
    seconds: float = 0.0        # all compiles so far
    fresh: float = 0.0          # compiles not yet reported in a step's stats
    keeps_graph: bool = False   # a backward runs twice on the graph (split backward's I, W)


def compile_program(module: fx.GraphModule, stage: int,
                    keeps_graph: bool = False) -> "tuple[fx.GraphModule, CompileRecord]":
    """The stage program cut into compiled and eager pieces (NOTE: Compiled stages): a
    GraphModule taking and returning what `module` does, sharing its parameters.
    `keeps_graph`: its backward runs with retain_graph (a split backward)."""
    record = CompileRecord(stage, keeps_graph=keeps_graph)
    module = inline_checkpoints(module)
    eager = _eager_nodes(module)
    record.eager = dict(Counter(eager.values()))
    top = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    pieces: Dict[str, torch.nn.Module] = {}

    def value(n: fx.Node) -> fx.Node:
        if n not in env:   # a parameter read by an eager node
            env[n] = top.get_attr(n.target)
        return env[n]
    for run, compiled in _runs(module.graph, eager):
        if not compiled:
            for node in run:
                env[node] = top.node_copy(node, value)
            continue
        name = f"piece_{len(pieces)}"
        piece, inputs, outputs = _piece(module, run)
        pieces[name] = CompiledPiece(piece, f"stage {stage} {name} ({_line(run[0])})", record)
        call = top.call_module(name, tuple(value(n) for n in inputs))
        for i, node in enumerate(outputs):
            env[node] = top.call_function(operator.getitem, (call, i))
    record.pieces = len(pieces)
    root = _holding(module, top, own=pieces)
    return fx.GraphModule(root, top, class_name=f"CompiledStage{stage}"), record


GRAPHC_OPS, RANDOM_OPS = "graphc ops (communication, losses)", "random ops"
CHECKPOINTED = "checkpointed modules with buffers"


def _eager_nodes(module: fx.GraphModule) -> Dict[fx.Node, str]:
    """The nodes that run as traced, each with why (NOTE: Compiled stages)."""
    eager = {}
    for node in module.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if _graphc_op(node):
            eager[node] = GRAPHC_OPS
        elif _draws(module, node):
            eager[node] = RANDOM_OPS
        elif node.op == "call_module" and isinstance(module.get_submodule(node.target), CheckpointedRegion):
            # one inline_checkpoints left: its buffers are restored for its recompute
            eager[node] = CHECKPOINTED
    return eager


def _graphc_op(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__module__", "").startswith("graphc.")


def _draws(module: fx.GraphModule, node: fx.Node) -> bool:
    """A random op (seed_random_ops rewrites those of several ranks into graphc's `seeded`;
    one rank's draw from its own generator, as eager does, and must stay eager's)."""
    if node.op == "call_function":
        if node.target is torch.nn.functional.scaled_dot_product_attention:
            p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
            return isinstance(p, fx.Node) or p != 0.0
        return id(node.target) in _RANDOM_TARGETS
    if node.op == "call_method":
        return node.target in RANDOM_METHODS
    if node.op == "call_module":
        return isinstance(module.get_submodule(node.target), _DROPOUT_MODULES)
    return False


def _runs(graph: fx.Graph, eager: set):
    """The program's compute nodes in order, cut into (run of nodes, compiled?) where the
    eager kind changes. get_attr nodes go where they are read (see _piece)."""
    run: List[fx.Node] = []
    compiled = None
    for node in graph.nodes:
        if node.op == "get_attr":
            continue
        if node.op in ("placeholder", "output"):
            if run:
                yield run, compiled
                run = []
            yield [node], False
            continue
        kind = node not in eager
        if run and kind != compiled:
            yield run, compiled
            run = []
        run.append(node)
        compiled = kind
    if run:
        yield run, compiled


def _piece(module: fx.GraphModule, run: List[fx.Node]):
    """A GraphModule of one run of nodes: its inputs are the values defined before it that
    it reads, its outputs the values it defines that later nodes read. Parameters and
    buffers it reads are its own attributes (the same tensors)."""
    inside = set(run)
    reads = [a for node in run for a in node.all_input_nodes if a not in inside]
    inputs = list(dict.fromkeys(a for a in reads if a.op != "get_attr"))
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {n: graph.placeholder(n.name) for n in inputs}
    for attr in dict.fromkeys(a for a in reads if a.op == "get_attr"):
        env[attr] = graph.get_attr(attr.target)
    for node in run:
        env[node] = graph.node_copy(node, lambda n: env[n])
    outputs = [n for n in run if any(u not in inside for u in n.users)]
    graph.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(_holding(module, graph), graph), inputs, outputs


def _holding(module: fx.GraphModule, graph: fx.Graph, own: Dict[str, torch.nn.Module] = {}) -> torch.nn.Module:
    """A module holding the attributes `graph` reads: the very objects of `module`, and the
    sub-modules `own` (the compiled pieces)."""
    root = torch.nn.Module()
    for name, piece in own.items():
        root.add_module(name, piece)
    for name, value in _attributes(module, graph, skip=own).items():
        _set_nested(root, name, value)
    return root


def _attributes(module: fx.GraphModule, graph: fx.Graph, skip=()) -> Dict[str, object]:
    """Every attribute a graph's get_attr and call_module nodes read, from `module`, but
    those named in `skip`."""
    out = {}
    for node in graph.nodes:
        if node.target in skip:
            continue
        if node.op == "get_attr":
            out[node.target] = _get_nested(module, node.target)
        elif node.op == "call_module":
            out[node.target] = module.get_submodule(node.target)
    return out


def _get_nested(module: torch.nn.Module, target: str):
    *path, last = target.split(".")
    for part in path:
        module = getattr(module, part)
    return getattr(module, last)


def _set_nested(root: torch.nn.Module, target: str, value) -> None:
    *path, last = target.split(".")
    for part in path:
        if not hasattr(root, part):
            root.add_module(part, torch.nn.Module())
        root = getattr(root, part)
    if isinstance(value, torch.nn.Parameter):
        root.register_parameter(last, value)
    elif isinstance(value, torch.nn.Module):
        root.add_module(last, value)
    elif isinstance(value, torch.Tensor):
        root.register_buffer(last, value)
    else:
        setattr(root, last, value)


class CompiledPiece(torch.nn.Module):
    """One run of plain ops, compiled by Inductor once per variant key (NOTE: Compiled stages)."""

    def __init__(self, piece: fx.GraphModule, name: str, record: CompileRecord):
        super().__init__()
        self.piece = piece
        self.name = name
        self.record = record
        self.variants: Dict[tuple, object] = {}

    def forward(self, *args):
        key = _variant_key(args)
        run = self.variants.get(key)
        if run is None:
            run = self.variants[key] = self._compile(args)
        out = run(*args)
        return out if isinstance(out, (tuple, list)) else (out,)

    def _compile(self, args):
        start = time.perf_counter()
        piece = recompute_variant(self.piece) if recomputing() and torch.is_grad_enabled() else self.piece
        try:
            with _COMPILE_LOCK:
                compiled = self._split(piece, args)
                if compiled is None:
                    compiled = _inductor(piece, args, self.record.keeps_graph)
        except Exception as exc:   # Inductor's own limits: this piece runs as traced, and says so
            warn_user(f"config.set_compile_stages: {self.name} runs uncompiled: Inductor failed "
                      f"({_first_line(exc)})")
            compiled = piece
        spent = time.perf_counter() - start
        self.record.seconds += spent
        self.record.fresh += spent
        return compiled


    def _split(self, piece: fx.GraphModule, args):
        """Under a split backward, the piece with its input and weight gradients compiled apart
        (NOTE: Split compiled backward); None where that does not apply or the joint export
        refuses the piece (it is then compiled whole, its backward run in I, as the warning says)."""
        if not (self.record.keeps_graph and torch.is_grad_enabled()):
            return None
        if not any(p.requires_grad for p in piece.parameters()):
            return None    # its whole backward is input gradients: nothing for W
        try:
            return build_split(piece, args, lambda graph, examples: _inductor(graph, examples, True))
        except Exception as exc:
            warn_user(f"config.set_compile_stages: {self.name}'s backward is compiled whole, its "
                      f"parameters' gradients computed in I with its inputs' (W only accumulates "
                      f"them): the joint export refused it ({_first_line(exc)})")
            return None


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: " + (str(exc).strip().splitlines() or [""])[0]


def _inductor(piece: fx.GraphModule, args, keeps_graph: bool):
    """compile_fx on `piece` for inputs like `args`, static shapes, in a tracing context whose
    fake mode has a ShapeEnv as Dynamo's has: without one, Inductor's FX graph cache and
    AOTAutograd's cache bypass ("No shape env"), and with one, real example inputs would be
    traced with symbolic sizes. A backward that keeps its graph (split backward: I with
    retain_graph, then W) may not donate saved buffers to its outputs, which AOTAutograd
    refuses at run time. Imports Inductor only when asked for."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fakes = [fake_mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]
    with tracing(TracingContext(fake_mode)), torch._functorch.config.patch(
            donated_buffer=not keeps_graph, backward_pass_autocast="off",
            enable_autograd_cache=not tagged_for_recompute(piece)), \
            torch._inductor.config.patch(emulate_precision_casts=True):
        return compile_fx(piece, fakes)


def _line(node: fx.Node) -> str:
    """The user's line a node was traced from, else its name."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    return trace[-1].strip() if trace else f"node '{node.name}'"


def _variant_key(args) -> tuple:
    """What AOTAutograd bakes into a compiled piece and a call may change."""
    return (torch.is_grad_enabled(), recomputing(), autocast_state(),
            tuple((a.requires_grad, a.dtype, a.shape, a.stride()) if isinstance(a, torch.Tensor) else a
                  for a in args))


def take_compile_seconds(records: Dict[int, CompileRecord]) -> Dict[int, float]:
    """Each stage's compile time since the last call (a step's share), logged, then reset."""
    out = {s: r.fresh for s, r in records.items() if r.fresh}
    for s, seconds in out.items():
        r = records[s]
        eager = ", ".join(f"{n} {why}" for why, n in r.eager.items()) or "none"
        _LOG.info(f"stage {s}: Inductor compiled {r.pieces} piece(s) in {seconds:.1f} s "
                  f"({r.seconds:.1f} s so far); nodes run as traced: {eager}")
        r.fresh = 0.0
    return out


def compile_stages(executors: Dict, plan: ExecutionPlan) -> Dict[int, CompileRecord]:
    """Each executor's program cut into compiled pieces (NOTE: Compiled stages); each stage's
    record. Under ZeRO stage 3 too: a release frees a parameter's storage in place and a gather
    gives it back (NOTE: ZeRO stage 3), so the parameters a compiled piece saves for its
    backward stay the very tensors, whole again when the backward reads them."""
    split = any(isinstance(ins, BackwardInput) for ins in plan.instructions)
    records = {}
    for s, ex in executors.items():
        ex.compute, records[s] = compile_program(ex.program.module, s, keeps_graph=split)
        # NOTE: Recompute in compiled pieces (a stage with no piece would save everything)
        ex.recompute_inside = records[s].pieces > 0 and not ex._buffers
    return records
