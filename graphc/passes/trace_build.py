"""trace_build: turns the user's Graph.build() into an fx graph, with the shapes of one micro-batch known.

Invariant: the result holds one node per op of build(), `loss.backward()` as a
call_method node with target "backward", user modules as call_module nodes whose
targets are the user's qualified names (e.g. "model.stage0.linear0"), custom
autograd Functions as opaque `Fn.apply` calls, and every node traced inside a
`torch.no_grad()` / `enable_grad()` region marked with META_GRAD_ENABLED.
Shapes are constants of the compiled graph: `x.size()`, `x.shape`, `x.dim()`, `len(x)`,
`x.dtype` return the example's values while tracing, so shape asserts, `if` on shapes,
`torch.arange(t)` and `view(b, t, ...)` trace as the author wrote them. Only control flow
on tensor *values* is refused. Tracing has no side effect on the user's modules: every
op runs on fake tensors (BatchNorm's running statistics and counters stay untouched).
Parameters reached any way are get_attr nodes, a tensor made in build() and written in
place is a per-call copy (NOTE: Tensors outside the trace), and what would run per trace
instead of per call (`self.step += 1`, an in-place write into a parameter) is refused
(NOTE: Attribute writes).
Requires: every module build() calls was assigned to the Graph in __init__.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import re
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.utils import _pytree as pytree

from ..errors import GraphcError
from ..guards import traced_frames
from ..meta import META_BATCHED, META_OUTPUT_TREE
from .build_tracer import FAKE, BuildTracer
from .traced_calls import patched_calls
from .traced_checkpoint import traced_checkpoints
from .traced_hooks import check_global_hooks, install_modules
from .traced_tensors import traced_tensors
from .traced_wraps import traced_wraps
from .traced_writes import check_item_writes
from .user_lines import node_line, traceback_line


def trace_build(root: torch.nn.Module, example_inputs: Sequence[torch.Tensor], num_microbatches: int = 1,
                batched: Optional[Sequence[bool]] = None, graph_name: str = "Graph",
                source_file: Optional[str] = None, autocast: Optional[tuple] = None,
                fakes=None) -> fx.GraphModule:
    """Traces build() (root's forward) for one micro-batch of `example_inputs` (their global shapes).

    batched: per input, whether it is split into micro-batches along dim 0 (default: every
    input with a dim). graph_name and source_file (the Graph's class name and the file that
    defines it) name the user's code in error messages. autocast: (device type, dtype) that
    build() runs under as a whole (config.enable_amp), as if written `with torch.autocast(...)`.
    fakes: the compile's CompileFakes to trace with (NOTE: One fake mode per compile); default new ones.
    """
    tracer = BuildTracer(root, fakes)
    tracer.source_file = source_file
    batched = [t.dim() >= 1 for t in example_inputs] if batched is None else list(batched)
    names = _input_names(root, len(example_inputs))
    tracer.examples = [_microbatch_example(tracer, t, num_microbatches, b, name)
                       for name, t, b in zip(names, example_inputs, batched)]
    outputs: Dict[str, Any] = {}
    check_global_hooks()  # NOTE: Module hooks (traced_hooks.py)
    attributes_before = set(vars(root))
    with _traced_root(root, len(example_inputs), outputs), patched_calls(tracer, source_file), \
            traced_checkpoints(tracer):  # torch.utils.checkpoint traces as its function
        try:
            with _autocast_regions(autocast), \
                    traced_tensors(tracer), traced_frames(), traced_wraps(tracer):  # NOTE: Tensors outside the trace
                g = tracer.trace(root)   # what its frames read is guarded (NOTE: Frame reads)
        except GraphcError:
            raise
        except Exception as e:  # fx raises TraceError, TypeError, ... on untraceable user code
            raise GraphcError(_explain_trace_failure(graph_name, source_file, e, tracer.failed)) from e
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise GraphcError(f"{graph_name}.build() takes {len(placeholders)} inputs "
                          f"({', '.join(p.name for p in placeholders)}), found {len(example_inputs)}. "
                          "Fix: call the graph with one tensor per build() argument.")
    for node, b in zip(placeholders, batched):
        node.meta[META_BATCHED] = b
    check_item_writes(g, tracer.item_writes, node_line)
    for node in g.nodes:
        node.meta.pop(FAKE, None)
    gm = _LazyGraphModule(root, g, class_name=type(root).__name__)   # NOTE: Code written when read
    _drop_constants(root, attributes_before)
    install_modules(gm, root, tracer.unhooked)  # hooked leaves run without their traced hooks
    if "tree" in outputs:
        gm.meta[META_OUTPUT_TREE] = outputs["tree"]
    return gm


def _drop_constants(root: torch.nn.Module, before: set) -> None:
    """The tensor constants fx left on the root while tracing (`_tensor_constant3`) taken off
    it once the traced module holds them: fx names a constant by the first free index on the
    root, so constants left by earlier traces (a recompile, the whole-batch trace) made the
    names, and with them the compile key, depend on how often a rank had traced: two ranks of
    one program disagreed (a list turned into a tensor in build() and edited between calls,
    on every layout of several ranks), and every recompile kept its constants alive."""
    for name in set(vars(root)) - before:
        if re.fullmatch(r"_tensor_constant\d+", name):
            delattr(root, name)


# NOTE: Code written when read
# The traced graph is annotated and rewritten by ~20 passes, and never run as a module: its
# stage programs are (split_stages builds them as GraphModules of their own). fx writes and
# compiles a GraphModule's Python at every recompile(), and after boxing that code names
# every rank group of every conversion (NOTE: Rank groups in code), a third of a rank's
# compile at 8192 ranks. fx's _LazyGraphModule (what torch.compile's graphs use) defers the
# writing to the first read of .code or the first call, so the traced graph's code is written
# only where something reads it (the history of graphc plan, a debugging print).
@contextmanager
def _autocast_regions(autocast: Optional[tuple]):
    """config.enable_amp's region around the trace. A cuda region is entered with a cpu region
    of the same dtype beside it: build() is traced on CPU stand-ins (NOTE: CUDA placement),
    which a cuda region alone does not cast, so every traced dtype was float32 and a plan of
    several ranks listed float32 transfers that the GPU then sends in bf16. CPU autocast casts
    the stand-ins as CUDA's casts the GPU's values for the ops that matter to a plan (linear,
    matmul, attention); the programs then set both regions, and on the GPU the cpu one casts
    nothing."""
    if not autocast:
        yield
        return
    device, dtype = autocast
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autocast(device, dtype))
        if device == "cuda":
            stack.enter_context(torch.autocast("cpu", dtype))
        yield


def _input_names(root: torch.nn.Module, n: int) -> List[str]:
    """build()'s argument names for n inputs (`xs[2]` for the third of `*xs`)."""
    params = list(inspect.signature(type(root).forward).parameters.values())[1:]
    names = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    star = next((p.name for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    names += [f"{star}[{i}]" for i in range(n - len(names))] if star else []
    return names + [f"input {i}" for i in range(len(names), n)]


def microbatch_shape(shape, m: int, batched: bool, name: str) -> List[int]:
    """One micro-batch's shape of an input: dim 0 divided by the m accumulation steps."""
    shape = list(shape)
    if batched and m > 1:
        if shape[0] % m:
            raise GraphcError(
                f"input '{name}' has batch size {shape[0]} along dim 0, which is not divisible by the {m} "
                f"gradient accumulation steps. Fix: use a batch size that is a multiple of {m}, or "
                "change config.set_gradient_accumulation_steps")
        shape[0] //= m
    return shape


def _microbatch_example(tracer: BuildTracer, t: torch.Tensor, m: int, batched: bool, name: str):
    shape = microbatch_shape(t.shape, m, batched, name)
    with tracer.fake_mode:
        return torch.empty(shape, dtype=t.dtype, device=t.device if t.device.type != "meta" else "cpu")


@contextmanager
def _traced_root(root: torch.nn.Module, n: int, outputs: Dict[str, Any]):
    """build(self, *xs) traced as build(self, x0, ..., x{n-1}) (fx cannot trace *args), and
    build()'s result flattened when it is a structure fx cannot hold (NOTE: Output trees)."""
    build = type(root).forward
    params = list(inspect.signature(build).parameters.values())[1:]
    fn = build
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        fixed = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                        inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        star = next(p.name for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL)
        names = fixed + [f"{star}_{i}" for i in range(max(0, n - len(fixed)))]
        src = f"def forward(self, {', '.join(names)}):\n    return build(self, {', '.join(names)})\n"
        scope: Dict[str, Any] = {"build": build}
        exec(src, scope)  # noqa: S102 - a fixed-arity wrapper, names from the user's signature
        fn = scope["forward"]

    flatten = _flat_outputs  # a closure cell: the function below runs in the user's globals

    def forward(self, *args, **kwargs):
        return flatten(fn(self, *args, **kwargs), outputs)

    # fx reads the argument names off the unwrapped function and patches math functions
    # in the globals of the one it calls: those of the user's build()
    forward = types.FunctionType(forward.__code__, getattr(build, "__globals__", {}), "forward",
                                 None, forward.__closure__)
    functools.update_wrapper(forward, fn)
    with forward_replaced(type(root), forward):
        yield


@contextmanager
def forward_replaced(cls: type, forward):
    """cls.forward is `forward` for the duration (the traced root's class only)."""
    original = cls.__dict__.get("forward")
    cls.forward = forward
    try:
        yield
    finally:
        if original is None:
            del cls.forward
        else:
            cls.forward = original


# NOTE: Output trees. build() may return any structure (a Hugging Face ModelOutput, a dict
# of dicts); fx holds tuples, lists and dicts. A structure with another container (a
# ModelOutput, registered as a pytree node by transformers) is returned to fx as the
# tuple of its leaves and its tree spec kept on the graph (gm.meta[META_OUTPUT_TREE]), so
# the Graph returns the user's own classes. A leaf that is neither a tensor nor a plain
# constant (a DynamicCache built while tracing) would be a stale object: refused.
_PLAIN_LEAVES = (bool, int, float, str, type(None), torch.dtype, torch.device)


def _flat_outputs(out, outputs: Dict[str, Any]):
    leaves, spec = pytree.tree_flatten(out)
    for leaf, (path, _) in zip(leaves, _paths(out)):
        if not isinstance(leaf, (fx.Proxy, torch.Tensor) + _PLAIN_LEAVES):
            raise GraphcError(
                f"build() returns a {type(leaf).__name__} at {_path_text(path)}: a Python object "
                "made while tracing would be returned unchanged on every step. Fix: return "
                "tensors (e.g. out.loss, out.logits); a Hugging Face model's cache is left out "
                "with use_cache=False.")
    if _builtin_tree(spec):
        return out
    outputs["tree"] = spec
    return tuple(leaves)


def _path_text(path) -> str:
    """A leaf's key path as Python would index it (`.past_key_values`, `['loss']`)."""
    if not path:
        return "its result"
    try:
        return pytree.keystr(path)
    except Exception:  # a key type without a text form
        return str(path)


def _paths(out):
    try:
        return pytree.tree_flatten_with_path(out)[0]
    except Exception:  # a node type without key paths: no names, the check still runs
        return [("", leaf) for leaf in pytree.tree_leaves(out)]


def _builtin_tree(spec) -> bool:
    """Is the structure only tuples, lists and dicts (which fx holds as they are)?"""
    if spec.type is None:
        return True
    children = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs
    return spec.type in (tuple, list, dict) and all(_builtin_tree(c) for c in children)


def _explain_trace_failure(graph_name: str, source_file: Optional[str], e: Exception,
                           failed: Optional[Dict[str, str]] = None) -> str:
    where = traceback_line(source_file, e.__traceback__)
    msg = str(e)
    # an op whose value could not be computed on fake tensors earlier leaves later code
    # (iterating its result, branching on it) without a value: that op is the cause
    first = next(iter((failed or {}).items()), None)
    if first is not None and "grouped_mm" in f"{first[0]} {first[1]}":
        return (f"graphc could not trace {graph_name}.build() at {where}: torch's '_grouped_mm' (the "
                f"default experts implementation of Hugging Face MoE models) failed on fake tensors "
                f"({first[1]}): its shape function accepts bfloat16 only, so the experts' outputs "
                "have no value while tracing (and torch's CPU kernel refuses float64). Fix: build the "
                "model with experts_implementation=\"batched_mm\" (in its config, or "
                "from_pretrained(..., experts_implementation=\"batched_mm\")), static shapes "
                "graphc trains on every layout.")
    if "dynamo-optimized" in msg:  # a torch.compile'd function (modules: check_traceable_module)
        fix = ("graphc compiles the whole step itself, and torch.compile's wrapper cannot be traced "
               "inside it. Fix: call the function itself, not torch.compile(fn), in build() and "
               "the modules' forward.")
    elif "control flow" in msg or "iteration" in msg or "bool" in msg.lower():
        fix = ("build() is traced once into a static graph, so Python control flow on a tensor's "
               "value (if/while over a tensor's value, bool(), .item() in a condition) cannot be "
               "recorded; control flow on shapes (x.size(), x.shape, len(x)) is fine. Fix: compute "
               "the condition outside build(), or use tensor ops such as torch.where instead of `if`.")
    else:
        fix = ("Fix: build() may only call modules assigned to the Graph in __init__, torch "
               "functions and tensor methods on its inputs.")
    cause = f"\n  an earlier op had no value on fake tensors: '{first[0]}': {first[1]}" if first else ""
    return (f"graphc could not trace {graph_name}.build() at {where}\n"
            f"  found: {type(e).__name__}: {msg.splitlines()[0] if msg else ''}{cause}\n  {fix}")


# NOTE: Retrace check
# Guards (graphc/guards/) name what a plan depends on; a path they do not see would let a
# plan run on a value it no longer matches. GRAPHC_RETRACE=1 is the oracle that finds such a
# path: on every call of a cached plan, build() is traced again for the call's inputs and
# its graph, as text (one line per node: its op, target, constant arguments, and a digest of
# every tensor constant), compared with the text the plan was compiled from. The first
# differing node names the user's line and both versions: the value the guards missed.
@dataclass(frozen=True)
class TraceText:
    """A traced build() as text: one entry per node, and the user's line that made it."""

    lines: Tuple[str, ...]
    where: Tuple[str, ...]

    def first_difference(self, now: "TraceText") -> Optional[Tuple[str, str, str]]:
        """(the user's line, the plan's text, the text now) of the first node that differs."""
        for i in range(max(len(self.lines), len(now.lines))):
            was = self.lines[i] if i < len(self.lines) else "(no node)"
            new = now.lines[i] if i < len(now.lines) else "(no node)"
            if was != new:
                where = now.where[i] if i < len(now.where) else self.where[i]
                return where, was, new
        return None


def traced_text(gm: fx.GraphModule) -> TraceText:
    """gm's nodes as TraceText (NOTE: Retrace check)."""
    lines, where = [], []
    ids: Dict[fx.Node, str] = {}   # nodes by position: fx's names (`_tensor_constant3`) count earlier traces
    for node in gm.graph.nodes:
        ids[node] = f"%{len(ids)}"
        target = _target_text(node.target)
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: ids.get(n, n.name))
        if node.op == "get_attr":
            value = _attr(gm, node.target)
            # a constant fx made of a tensor the trace met (buffers change every step: by name)
            if isinstance(value, torch.Tensor) and re.fullmatch(r"_tensor_constant\d+", node.target):
                target = f"constant {_digest(value)}"   # a tensor constant by its value, not its name
        text = f"{ids[node]} = {node.op}[{target}]{args!r}"
        lines.append(text)
        where.append(node_line(node) if node.meta.get("stack_trace") else node.format_node())
    return TraceText(tuple(lines), tuple(where))


def _target_text(target) -> str:
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"


def _attr(gm: fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _digest(t: torch.Tensor) -> str:
    """A tensor constant's dtype, shape and a hash of its values."""
    if t.device.type == "meta" or isinstance(t, torch._subclasses.FakeTensor):
        return f"{t.dtype}{list(t.shape)}"
    data = t.detach().cpu().contiguous()
    raw = data.view(torch.uint8) if data.dim() else data.reshape(1).view(torch.uint8)
    return f"{t.dtype}{list(t.shape)}#{hashlib.sha1(raw.numpy().tobytes()).hexdigest()[:12]}"
