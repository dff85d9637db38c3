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
Requires: every module build() calls was assigned to the Graph in __init__.
"""
from __future__ import annotations

import builtins
import contextlib
import copy
import functools
import inspect
import os
import random
import traceback
import types
from contextlib import contextmanager
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
from torch.utils import _pytree as pytree

from ..errors import GraphcError
from ..meta import META_AUTOCAST, META_BATCHED, META_GRAD_ENABLED, META_OUTPUT_TREE
from ..ops.autocast import autocast_state
from .traced_checkpoint import traced_checkpoints
from .traced_writes import check_item_writes, write_item
from .unsupported_modules import check_runnable_module

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_GRAPHC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_FAKE = "graphc_fake"  # node.meta key for the value while tracing; removed when tracing ends

# attributes and methods of a tensor that tell its shape, dtype or device: answered from
# the example, so they are Python values (constants of the compiled graph), not nodes
_SHAPE_ATTRS = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "layout", "is_sparse",
                          "is_quantized", "is_meta", "T_shape"})
_SHAPE_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement", "element_size",
                            "is_floating_point", "is_complex", "get_device", "is_contiguous"})
# calls that must not happen inside build(): they act on real gradients the trace never has
_REFUSED_CALLS = {
    "clip_grad_norm_": "gradient clipping runs on gradients after backward; build() only sees "
                       "symbolic tensors, so this call would clip nothing. Fix: remove it and set "
                       "self.config.set_grad_clip_norm(max_norm) in the Graph's __init__ (the "
                       "global norm over every stage and shard, equal to clip_grad_norm_ on the "
                       "whole model).",
    "clip_grad_value_": "gradient clipping runs on gradients after backward; build() only sees "
                        "symbolic tensors, so this call would clip nothing. Fix: remove it; clip by "
                        "norm with self.config.set_grad_clip_norm(max_norm), or clip values in "
                        "the optimizer.",
}


# random factories take no tensor input, so fx would run them once while tracing and bake
# the draw into the graph as a constant; they are recorded as nodes instead
_RANDOM_FACTORIES = ("rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial",
                     "poisson", "rand_like", "randn_like", "randint_like")


_SCALER_WHY = ("loss scaling is automatic mixed precision (AMP) state that lives across steps "
               "(the scale, the inf/nan check over every rank and stage, the skipped step), which "
               "a traced build() cannot hold; traced, the scaled gradients would reach the "
               "optimizer unscaled. Fix: remove the GradScaler from build() and give the graph "
               "its own in __init__: self.config.enable_amp(True, dtype=torch.float16); "
               "self.set_grad_scaler(graphc.amp.GradScaler()) (bfloat16 autocast needs no loss "
               "scaling).")
_RANDOM_WHY = ("build() is traced once, so the number drawn while tracing would be a constant of "
               "the plan (every step would, e.g., drop the same layer), unlike eager, which draws "
               "anew on every call. Fix: draw with torch (p = torch.rand(()); use "
               "torch.where(p < drop_prob, h, layer(h)) to skip a layer), which graphc records as "
               "a random op drawn on every step; or draw outside build() and pass the result as "
               "an input.")
# Python's own random draws: a draw while tracing would be frozen into the plan (refused)
_PYTHON_RANDOM = ("random", "uniform", "randint", "randrange", "choice", "choices", "sample",
                  "shuffle", "gauss", "normalvariate", "betavariate", "expovariate")


class ShapeProxy(fx.Proxy):
    """An fx Proxy that answers shape questions from the example it was traced with."""

    # nn.Parameter's isinstance check reads this of anything that is a Tensor (NOTE:
    # isinstance while tracing): a traced value is never a parameter
    _is_param = False

    def __getattr__(self, k: str):
        if k in _SHAPE_ATTRS or k in _SHAPE_METHODS:
            return getattr(self.tracer.fake_of(self), k)
        fields = _result_fields(self.node.meta.get(_FAKE))
        if k in fields:  # torch.topk(x, k).values: the named result's field, as getitem
            return self[fields.index(k)]
        return super().__getattr__(k)

    def __setitem__(self, index, value) -> None:  # NOTE: Item writes (traced_writes.py)
        write_item(self.tracer, self, index, value, _deepest_user_frame(None, traceback.extract_stack()))

    def __len__(self) -> int:
        return len(self.tracer.fake_of(self))


    def __iter__(self):
        value = self.node.meta.get(_FAKE)
        if isinstance(value, (tuple, list)):
            return iter([self[i] for i in range(len(value))])
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return iter([self[i] for i in range(value.shape[0])])
        return super().__iter__()


class BuildTracer(fx.Tracer):
    """fx.Tracer that runs every op on fake tensors as it records it (see module docstring)."""

    def __init__(self, root: torch.nn.Module):
        super().__init__()
        self.record_stack_traces = True
        self.proxy_buffer_attributes = True  # buffers updated in forward are recorded, not run once
        self.trace_root = root
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.examples: List[Any] = []
        self.examples_used: List[fx.Node] = []
        self.failed: Dict[str, str] = {}  # node name -> why its value is unknown
        self.running_fake = False  # a leaf module runs on fakes: fx's patches step aside
        self.source_file: Optional[str] = None  # the Graph's file, for error messages
        self.item_writes: list = []  # (set_item node, nodes sharing its input's storage, line)
        self._modules_seen: Optional[list] = None

    def call_module(self, m, forward, args, kwargs):
        if self.running_fake:
            return forward(*args, **kwargs)
        if not any(m is sub for sub in self._known_modules()):
            return self._call_unowned(m, forward, args, kwargs)
        return super().call_module(m, forward, args, kwargs)

    def _known_modules(self):
        if self._modules_seen is None:
            self._modules_seen = [sub for _, sub in self.trace_root.named_modules(remove_duplicate=False)]
        return self._modules_seen

    def _call_unowned(self, m, forward, args, kwargs):
        """A module built inside a forward (BERT's `CrossEntropyLoss()` in its forward): traced
        through, like the functional it calls, when it holds no state to train or keep."""
        state = [n for n, _ in list(m.named_parameters()) + list(m.named_buffers())]
        if state:
            raise GraphcError(
                f"build() calls a {type(m).__name__} at {_caller_line(self.source_file)} that was "
                f"created during the step (not assigned in __init__), and it holds {state[:3]}: "
                "graphc (like eager PyTorch's optimizer) could not train or save them, and a new "
                "one would be made on every call. Fix: create it once in __init__ (as an "
                "attribute of the model or the Graph).")
        return forward(*args, **kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self.running_fake:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    # -- fake values ------------------------------------------------------------------
    def fake_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """The fake of a real tensor; the same real tensor (a tied weight) gives the same fake."""
        return self.fake_mode.from_tensor(t, static_shapes=True)

    def node_fake(self, node: fx.Node):
        """The value of `node` while tracing, None where unknown."""
        return node.meta.get(_FAKE)

    def fake_of(self, proxy: fx.Proxy):
        node = proxy.node
        if _FAKE not in node.meta:
            why = self.failed.get(node.name, "it is not a tensor graphc can follow")
            raise GraphcError(
                f"build() asks for the shape of '{node.name}' ({node.format_node()}), but graphc "
                f"could not compute its value while tracing: {why}. Fix: check the op's inputs "
                "(shapes, dtypes) at that line.")
        return node.meta[_FAKE]

    def create_arg(self, a):
        if type(a) is ShapeProxy:  # before fx's Tensor and Parameter cases (NOTE: isinstance while tracing)
            return a.node
        return super().create_arg(a)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return ShapeProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None,
                     proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        node = proxy.node
        node.meta[META_GRAD_ENABLED] = torch.is_grad_enabled()
        node.meta[META_AUTOCAST] = autocast_state()  # NOTE: Autocast regions
        if kind == "placeholder":
            index = len(self.examples_used)
            self.examples_used.append(node)
            if index < len(self.examples):
                node.meta[_FAKE] = self.examples[index]
            return proxy
        if kind == "call_method" and target == "backward":
            return proxy
        try:
            node.meta[_FAKE] = self._run_fake(kind, target, args, kwargs)
        except GraphcError:
            raise
        except DynamicOutputShapeException as e:
            raise GraphcError(_data_dependent_shape(node, e)) from e
        except Exception as e:  # the value stays unknown; propagate_shapes reports the failure
            self.failed[node.name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return proxy

    def _run_fake(self, kind, target, args, kwargs):
        fargs = fx.node.map_aggregate(args, self._fake_arg)
        fkwargs = fx.node.map_aggregate(kwargs, self._fake_arg)
        with self.fake_mode:
            if kind == "call_function":
                return target(*fargs, **fkwargs)
            if kind == "call_method":
                return getattr(fargs[0], target)(*fargs[1:], **fkwargs)
            if kind == "call_module":
                return self._run_module_fake(target, fargs, fkwargs)
            if kind == "get_attr":
                return self._fake_attr(target)
        raise NotImplementedError(kind)

    def _fake_arg(self, a):
        if isinstance(a, fx.Proxy):
            a = a.node
        if isinstance(a, fx.Node):
            if _FAKE not in a.meta:
                raise RuntimeError(f"the value of '{a.name}' is unknown")
            return a.meta[_FAKE]
        if isinstance(a, torch.Tensor) and not isinstance(a, torch._subclasses.FakeTensor):
            return self.fake_tensor(a)
        return a

    def _fake_attr(self, target: str):
        self.running_fake = True  # reading the attribute must not record another get_attr
        try:
            value = self.trace_root
            for part in target.split("."):
                value = getattr(value, part)
        finally:
            self.running_fake = False
        return self.fake_tensor(value) if isinstance(value, torch.Tensor) else value

    def _run_module_fake(self, target: str, fargs, fkwargs):
        """A leaf module on fakes of its own parameters and buffers: its real state is untouched."""
        self.running_fake = True
        try:
            return run_module_on_fakes(self.trace_root.get_submodule(target), fargs, fkwargs,
                                       self.fake_tensor)
        finally:
            self.running_fake = False

    # -- where errors point -----------------------------------------------------------
    def _filter_traceback_frames(self, summary: traceback.StackSummary) -> traceback.StackSummary:
        """The user's frames from build() down, so errors can point at the user's line.

        fx's own filter keeps frames from the first `forward` on, which drops build() itself.
        """
        starts = [i for i, f in enumerate(summary) if f.filename.startswith(_TORCH_DIR + "fx" + os.sep)
                  and f.name == "trace"]
        frames = summary[starts[-1] + 1:] if starts else summary
        return traceback.StackSummary.from_list(
            [f for f in frames if not f.filename.startswith((_TORCH_DIR, _GRAPHC_DIR))])


def run_module_on_fakes(module: torch.nn.Module, args, kwargs, fake):
    """A leaf module's output on fakes of its own parameters and buffers: its state is untouched.

    BatchNorm with momentum=None reads its counter as a Python number, which a fake cannot
    give; the counter only steers the running statistics, not the output, so the shape run
    uses a shallow copy with a fixed momentum.
    """
    check_runnable_module(module, args)  # torch's refusals, as GraphcErrors with the fix
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.momentum is None:
        module = copy.copy(module)
        module.momentum = 0.1
    state = {k: fake(v) for k, v in list(module.named_parameters(remove_duplicate=False)) +
             list(module.named_buffers(remove_duplicate=False))}
    return torch.func.functional_call(module, state, tuple(args), dict(kwargs),
                                      tie_weights=False, strict=False)


def trace_build(root: torch.nn.Module, example_inputs: Sequence[torch.Tensor], num_microbatches: int = 1,
                batched: Optional[Sequence[bool]] = None, graph_name: str = "Graph",
                source_file: Optional[str] = None, autocast: Optional[tuple] = None) -> fx.GraphModule:
    """Traces build() (root's forward) for one micro-batch of `example_inputs` (their global shapes).

    batched: per input, whether it is split into micro-batches along dim 0 (default: every
    input with a dim). graph_name and source_file (the Graph's class name and the file that
    defines it) name the user's code in error messages. autocast: (device type, dtype) that
    build() runs under as a whole (config.enable_amp), as if written `with torch.autocast(...)`.
    """
    tracer = BuildTracer(root)
    tracer.source_file = source_file
    batched = [t.dim() >= 1 for t in example_inputs] if batched is None else list(batched)
    names = _input_names(root, len(example_inputs))
    tracer.examples = [_microbatch_example(tracer, t, num_microbatches, b, name)
                       for name, t, b in zip(names, example_inputs, batched)]
    outputs: Dict[str, Any] = {}
    with _traced_root(root, len(example_inputs), outputs), _patched_calls(tracer, source_file), \
            traced_checkpoints(tracer):  # torch.utils.checkpoint traces as its function
        try:
            with torch.autocast(*autocast) if autocast else contextlib.nullcontext():
                g = tracer.trace(root)
        except GraphcError:
            raise
        except Exception as e:  # fx raises TraceError, TypeError, ... on untraceable user code
            raise GraphcError(_explain_trace_failure(graph_name, source_file, e)) from e
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise GraphcError(f"{graph_name}.build() takes {len(placeholders)} inputs "
                          f"({', '.join(p.name for p in placeholders)}), found {len(example_inputs)}. "
                          "Fix: call the graph with one tensor per build() argument.")
    for node, b in zip(placeholders, batched):
        node.meta[META_BATCHED] = b
    check_item_writes(g, tracer.item_writes, _node_line)
    for node in g.nodes:
        node.meta.pop(_FAKE, None)
    gm = fx.GraphModule(root, g, class_name=type(root).__name__)
    if "tree" in outputs:
        gm.meta[META_OUTPUT_TREE] = outputs["tree"]
    return gm


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
                f"build() returns a {type(leaf).__name__} at {path or 'its result'}: a Python object "
                "made while tracing would be returned unchanged on every step. Fix: return "
                "tensors (e.g. out.loss, out.logits); a Hugging Face model's cache is left out "
                "with use_cache=False.")
    if _builtin_tree(spec):
        return out
    outputs["tree"] = spec
    return tuple(leaves)


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


# NOTE: isinstance while tracing. A model (or a library: transformers' masking_utils) that
# asks `isinstance(x, torch.Tensor)` of a traced value must take eager's branch, where x is
# a tensor. While tracing, Python's isinstance answers True for a ShapeProxy whose value is
# a tensor. It is the builtin that changes, not the proxy's __class__: torch's C++ argument
# parser also consults __class__, took such a proxy for a real tensor and crashed
# (torch.pow(x, 3.0) in GPT-2's gelu_new: a segfault).
_ISINSTANCE = builtins.isinstance


def _tensor_class(cls) -> bool:
    if cls is torch.Tensor:
        return True
    return type(cls) is tuple and any(c is torch.Tensor for c in cls)


def _traced_isinstance(obj, cls):
    if type(obj) is ShapeProxy and _tensor_class(cls) and _ISINSTANCE(obj.node.meta.get(_FAKE), torch.Tensor):
        return True
    return _ISINSTANCE(obj, cls)


@contextmanager
def _patched_calls(tracer: BuildTracer, source_file: Optional[str]):
    """While tracing: custom autograd Functions stay opaque calls; refused calls raise."""
    original_apply = torch.autograd.Function.__dict__["apply"]  # the classmethod itself

    def apply(cls, *args, **kwargs):
        proxies = []
        fx.node.map_aggregate((args, kwargs), lambda a: proxies.append(a) if isinstance(a, fx.Proxy) else a)
        if not proxies:
            return original_apply.__func__(cls, *args, **kwargs)
        return tracer.create_proxy("call_function", _function_apply(cls), args, kwargs)

    def refusal(what: str, why: str):
        def call(*args, **kwargs):
            raise GraphcError(f"build() calls {what} at {_caller_line(source_file)}: {why}")
        return call

    scaler_methods = [(torch.amp.GradScaler, name, torch.amp.GradScaler.__dict__[name])
                      for name in ("scale", "unscale_", "step", "update")]
    original_setattr = torch.nn.Module.__setattr__

    def module_setattr(module, name, value):
        buffers = module.__dict__.get("_buffers")
        if isinstance(value, fx.Proxy) and buffers is not None and name in buffers:
            return _assign_buffer(tracer, source_file, module, name, value)
        return original_setattr(module, name, value)

    def recorded(name, fn):
        def call(*args, **kwargs):  # a fresh draw on every step, not a constant of the trace
            if tracer.running_fake:
                return fn(*args, **kwargs)
            return tracer.create_proxy("call_function", fn, args, kwargs)
        call.__name__ = name
        return call

    factories = [(torch, name, getattr(torch, name)) for name in _RANDOM_FACTORIES]
    python_random = [(random, name, getattr(random, name)) for name in _PYTHON_RANDOM]


    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_grad
    saved = [(obj, name, getattr(obj, name)) for obj in (nn_utils, clip_grad) for name in _REFUSED_CALLS]
    torch.autograd.Function.apply = classmethod(apply)
    builtins.isinstance = _traced_isinstance  # NOTE: isinstance while tracing
    torch.nn.Module.__setattr__ = module_setattr
    for obj, name, fn in factories:
        setattr(obj, name, recorded(name, fn))
    for obj, name, _ in python_random:
        setattr(obj, name, refusal(f"Python's random.{name}()", _RANDOM_WHY))
    for obj, name, _ in scaler_methods:
        setattr(obj, name, refusal(f"GradScaler.{name}()", _SCALER_WHY))
    for obj, name, _ in saved:
        setattr(obj, name, refusal(f"torch.nn.utils.{name}", _REFUSED_CALLS[name]))
    try:
        yield
    finally:
        builtins.isinstance = _ISINSTANCE
        torch.autograd.Function.apply = original_apply
        torch.nn.Module.__setattr__ = original_setattr
        for obj, name, fn in factories + python_random + scaler_methods:
            setattr(obj, name, fn)
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def assign_buffer(buffer: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`module.buf = value` in forward, as a stage program runs it: the buffer takes the value."""
    with torch.no_grad():
        return buffer.copy_(value)


def _assign_buffer(tracer: BuildTracer, source_file: Optional[str], module, name: str, value: fx.Proxy) -> None:
    """`self.buf += 1` is in place already (recorded); `self.buf = expr` copies into the buffer."""
    node = value.node
    first = node.args[0] if node.args else None
    if isinstance(first, fx.Node) and first.op == "get_attr" and str(node.target).endswith(("iadd", "isub",
                                                                                             "imul", "itruediv")):
        return
    fake = node.meta.get(_FAKE)
    if isinstance(fake, torch.Tensor) and fake.requires_grad:
        raise GraphcError(
            f"build() assigns a value that requires grad to the buffer '{name}' of "
            f"{type(module).__name__} at {_caller_line(source_file)}; the buffer would carry this "
            "step's autograd graph into the next step. Fix: assign value.detach(), or update it "
            "under torch.no_grad().")
    holder = tracer.path_of_module(module)
    target = f"{holder}.{name}" if holder else name
    buffer = tracer.create_proxy("get_attr", target, (), {})
    tracer.create_proxy("call_function", assign_buffer, (buffer, value), {})


_APPLY_CACHE: Dict[type, Any] = {}


def _function_apply(cls):
    """A named callable for `cls.apply`, so the fx code reads `MyFn_apply(x)` and pickles."""
    fn = _APPLY_CACHE.get(cls)
    if fn is None:
        def fn(*args, **kwargs):
            return cls.apply(*args, **kwargs)
        fn.__name__ = f"{cls.__name__}_apply"
        fn.__qualname__ = fn.__name__
        fn.graphc_autograd_function = cls
        _APPLY_CACHE[cls] = fn
    return fn


def _data_dependent_shape(node: fx.Node, e: Exception) -> str:
    """Why an op whose result's shape depends on the data (nonzero, torch.where(cond),
    masked_select, unique, x[bool_mask]) cannot be in a plan, and the static forms."""
    op = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    where = _deepest_user_frame(None, traceback.extract_stack())
    return (f"build() calls '{op}' at {where}: the shape of its result depends on the values in "
            f"the tensors ({str(e).strip()}), and graphc compiles one static plan for every step. "
            "Fix: keep shapes static: torch.where(mask, x, 0) or masked_fill instead of x[mask], "
            "fixed-size index tensors (topk, gather, index_add of every token with zero weights) "
            "instead of the positions nonzero finds. A mixture-of-experts layer that loops over "
            "the experts it hit (transformers' experts_implementation='eager') can dispatch every "
            "token's top-k slots at once: experts_implementation='batched_mm' for transformers' "
            "models, which graphc traces.")


def _result_fields(value) -> tuple:
    """The field names of a named result of torch (torch.return_types.topk: values, indices)."""
    if isinstance(value, tuple) and type(value).__module__ == "torch.return_types":
        return type(value).__match_args__
    return ()


def _node_line(node: fx.Node) -> str:
    """'File ..., line n, in f: code' of the user's line that recorded `node`."""
    trace = node.meta.get("stack_trace", "").strip().splitlines()
    return f"{trace[-2].strip()}: {trace[-1].strip()}" if len(trace) >= 2 else node.format_node()


def _caller_line(source_file: Optional[str]) -> str:
    """'file:line: code' of the user's frame that is calling now (see _deepest_user_frame)."""
    return _deepest_user_frame(source_file, traceback.extract_stack())


def _user_line(source_file: Optional[str], tb) -> str:
    """'file:line: code' of the user's frame in a traceback (see _deepest_user_frame)."""
    return _deepest_user_frame(source_file, traceback.extract_tb(tb))


def _deepest_user_frame(source_file: Optional[str], frames) -> str:
    """The deepest frame of the user's Graph file (source_file), else of any file outside
    torch and graphc."""
    mine = [f for f in frames if f.filename == source_file] or \
        [f for f in frames if not f.filename.startswith((_TORCH_DIR, _GRAPHC_DIR))]
    if not mine:
        return "build()"
    f = mine[-1]
    return f"{f.filename}:{f.lineno}: {f.line}"


def _explain_trace_failure(graph_name: str, source_file: Optional[str], e: Exception) -> str:
    where = _user_line(source_file, e.__traceback__)
    msg = str(e)
    if "control flow" in msg or "iteration" in msg or "bool" in msg.lower():
        fix = ("build() is traced once into a static graph, so Python control flow on a tensor's "
               "value (if/while over a tensor's value, bool(), .item() in a condition) cannot be "
               "recorded; control flow on shapes (x.size(), x.shape, len(x)) is fine. Fix: compute "
               "the condition outside build(), or use tensor ops such as torch.where instead of `if`.")
    else:
        fix = ("Fix: build() may only call modules assigned to the Graph in __init__, torch "
               "functions and tensor methods on its inputs.")
    return (f"graphc could not trace {graph_name}.build() at {where}\n"
            f"  found: {type(e).__name__}: {msg.splitlines()[0] if msg else ''}\n  {fix}")
