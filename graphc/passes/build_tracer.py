"""BuildTracer: the fx tracer of trace_build, which runs every op on fake tensors as it
records it, and ShapeProxy, the proxy that answers shape questions (x.shape, x.size(),
len(x), x.dtype) from those values, so they are constants of the compiled graph (see
trace_build's docstring). The fakes live in node.meta[FAKE] until tracing ends."""
from __future__ import annotations

import contextlib
import copy
import functools
import sys
from typing import Any, Dict, List, Optional

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor, FakeTensorMode

from ..errors import GraphcError
from ..guards import frames_unobserved
from ..meta import META_AUTOCAST, META_GRAD_ENABLED
from ..ops.autocast import autocast_state
from .traced_experts import experts_activation, traced_experts_call
from .traced_hooks import check_backward_hooks, has_forward_hooks, run_forward_hooks, without_forward_hooks
from .traced_tensors import IN_PLACE_OPERATORS, refuse_grad_read, refuse_parameter_write, writes_in_place
from .traced_writes import in_place_twin, write_in_place, write_item
from .unsupported_modules import check_runnable_module, check_traceable_module
from .verify_graph import host_sync_refused
from .user_lines import GRAPHC_DIR, TORCH_DIR, caller_line, deepest_user_frame, live_frames, user_stack_trace

FAKE = "graphc_fake"  # node.meta key for the value while tracing; removed when tracing ends

# attributes and methods of a tensor that tell its shape, dtype or device: answered from
# the example, so they are Python values (constants of the compiled graph), not nodes
_SHAPE_ATTRS = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "layout", "is_sparse",
                          "is_quantized", "is_meta", "is_nested", "T_shape"})
_SHAPE_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement", "element_size",
                            "is_floating_point", "is_complex", "get_device", "is_contiguous"})
# the same questions asked as torch functions (torch.is_floating_point(mask) in torch's own
# mask handling, F._canonical_mask)
_SHAPE_FUNCTIONS = frozenset({torch.is_floating_point, torch.is_complex, torch.numel})


def _calling_line() -> str:
    """The user's line calling now, as node_line writes a node's ('File ..., line n, in f: code')."""
    frames = [f for f in live_frames(sys._getframe(1)) if not f.filename.startswith((TORCH_DIR, GRAPHC_DIR))]
    if not frames:
        return "build()"
    f = frames[-1]
    return f'File "{f.filename}", line {f.lineno}, in {f.name}: {f.line}'


class CompileFakes:
    """One compile's FakeTensorMode and the fakes of the parameters it made, kept for the
    compile (NOTE: One fake mode per compile)."""

    def __init__(self):
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.parameters: Dict[int, tuple] = {}   # id(parameter) -> (parameter, its fake)


def cpu_fake(mode: FakeTensorMode, t: torch.Tensor, memo: Dict[int, tuple],
             parameters: Optional[Dict[int, tuple]] = None) -> torch.Tensor:
    """The fake a trace uses for real tensor t: on the CPU, whatever device t is on.

    build() is traced on CPU stand-ins of its inputs (NOTE: CUDA placement,
    runtime/device.py), so a model already on its GPU (or on the meta device) must be traced
    on CPU fakes of its parameters and buffers too, or every op mixing the two fails. The
    same real tensor (a tied weight) gives the same fake (`memo`, as from_tensor's own).
    `parameters`: a compile's fakes of parameters, made once for all its passes (NOTE: One
    fake mode per compile)."""
    if parameters is not None and isinstance(t, torch.nn.Parameter) and not isinstance(t, FakeTensor):
        found = parameters.get(id(t))
        if found is None:
            found = parameters[id(t)] = (t, cpu_fake(mode, t, memo))
        return found[1]
    if t.device.type == "cpu" or isinstance(t, FakeTensor):
        return mode.from_tensor(t, static_shapes=True)
    found = memo.get(id(t))
    if found is None:
        with mode:
            fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) \
                else fake.requires_grad_(t.requires_grad)
        found = memo[id(t)] = (t, fake)   # t kept alive: its id is not reused while the memo lives
    return found[1]


class ShapeProxy(fx.Proxy):
    """An fx Proxy that answers shape questions from the example it was traced with."""

    # nn.Parameter's isinstance check reads this of anything that is a Tensor (NOTE:
    # isinstance while tracing): a traced value is never a parameter
    _is_param = False

    def __getattr__(self, k: str):
        if k in _SHAPE_ATTRS or k in _SHAPE_METHODS:
            return getattr(self.tracer.fake_of(self), k)
        if k in ("tolist", "numpy"):   # values into Python, often used at once (len(x.tolist()))
            raise host_sync_refused(k, _calling_line())
        if k == "grad":   # a traced value's gradient: none while tracing (See refuse_grad_read)
            raise refuse_grad_read(str(self.node.target if self.node.op == "get_attr" else self.node.name),
                                   deepest_user_frame(None, live_frames()))
        fields = _result_fields(self.node.meta.get(FAKE))
        if k in fields:  # torch.topk(x, k).values: the named result's field, as getitem
            return self[fields.index(k)]
        if writes_in_place(k) and in_place_twin(k) and isinstance(self.node.meta.get(FAKE), torch.Tensor):
            return functools.partial(self._write, k)   # NOTE: In-place methods
        return super().__getattr__(k)

    def _write(self, method: str, *args, **kwargs) -> "ShapeProxy":
        where = deepest_user_frame(self.tracer.source_file, live_frames())
        return write_in_place(self.tracer, self, method, where, *args, **kwargs)

    @classmethod
    def __torch_function__(cls, orig_method, types, args=None, kwargs=None):
        if orig_method in _SHAPE_FUNCTIONS and args and type(args[0]) is ShapeProxy:
            return orig_method(args[0].tracer.fake_of(args[0]), *args[1:], **(kwargs or {}))
        return super().__torch_function__(orig_method, types, args, kwargs)

    def __setitem__(self, index, value) -> None:  # NOTE: Item writes (traced_writes.py)
        write_item(self.tracer, self, index, value, deepest_user_frame(None, live_frames()))

    def __len__(self) -> int:
        return len(self.tracer.fake_of(self))

    # NOTE: Augmented assignment
    # `h += x` on a tensor is Tensor.__iadd__, the in-place add_: the result keeps h's dtype
    # (HF's `loss += coef * aux_loss` stays float32 with a float64 aux) and every other name
    # for h sees the change (`r = h; h += 1` changes r). fx's Proxy has no __iadd__, so Python
    # falls back to `h = h + x`: a new value, promoted dtype, r unchanged -- silently another
    # program. A traced tensor's augmented assignment is the in-place method, as if the user
    # had written h.add_(x) (NOTE: In-place methods); any other value takes the operator.
    def _in_place(self, method: str, other):
        if isinstance(self.node.meta.get(FAKE), torch.Tensor):
            return getattr(self, method)(other)
        return NotImplemented


    def __iter__(self):
        value = self.node.meta.get(FAKE)
        if isinstance(value, (tuple, list)):
            return iter([self[i] for i in range(len(value))])
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return iter([self[i] for i in range(value.shape[0])])
        return super().__iter__()


for _operator, _method in IN_PLACE_OPERATORS.items():   # h += x is h.add_(x): NOTE: Augmented assignment
    setattr(ShapeProxy, _operator, lambda self, other, method=_method: self._in_place(method, other))


# NOTE: Composite torch layers
# fx keeps every torch.nn module a leaf: one call_module node, run whole. For torch's
# Transformer layers that makes the layer one op without an SBP rule (a fallback gathering a
# split batch) and hides their MultiheadAttention and Linears from declared layouts. They are
# traced through instead, as a user's own module is; while tracing, their inference fast
# path is off (it branches on tensor values; traced_calls.patched_calls) and a mask passed
# without is_causal is not compared with the causal mask (is_causal False: the mask is
# applied as given, which equals eager's causal kernel).
_TRACED_THROUGH = (torch.nn.TransformerEncoder, torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoder,
                   torch.nn.TransformerDecoderLayer, torch.nn.Transformer)


class BuildTracer(fx.Tracer):
    """fx.Tracer that runs every op on fake tensors as it records it (see module docstring)."""

    def __init__(self, root: torch.nn.Module, fakes: Optional[CompileFakes] = None):
        super().__init__()
        # the user's frames per node, recorded by create_node (NOTE: Recorded user lines)
        self.record_stack_traces = False
        self.proxy_buffer_attributes = True  # buffers updated in forward are recorded, not run once
        self.trace_root = root
        # a compile's one mode and parameters' fakes (NOTE: One fake mode per compile), else its own
        fakes = CompileFakes() if fakes is None else fakes
        self.fake_mode, self.fake_parameters = fakes.mode, fakes.parameters
        self.stand_ins: Dict[int, tuple] = {}   # cpu_fake's memo: id(real) -> (real, its fake)
        self.examples: List[Any] = []
        self.examples_used: List[fx.Node] = []
        self.failed: Dict[str, str] = {}  # node name -> why its value is unknown
        self.running_fake = False  # a leaf module runs on fakes: fx's patches step aside
        self.source_file: Optional[str] = None  # the Graph's file, for error messages
        self.item_writes: list = []  # (set_item node, nodes sharing its input's storage, line)
        self._modules_seen: Optional[list] = None
        self._first_names: Dict[int, str] = {}   # id(module) -> its first qualified name
        # qualified name -> the hooked leaf without its forward hooks, which its call_module
        # node runs (NOTE: Module hooks, traced_hooks.py); trace_build installs them
        self.unhooked: Dict[str, torch.nn.Module] = {}
        self._hooks_traced: Optional[torch.nn.Module] = None  # the hooked leaf being traced through

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        # NOTE: Composite torch layers; a hooked leaf's own call (NOTE: Module hooks)
        if isinstance(m, _TRACED_THROUGH) or m is self._hooks_traced:
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m, forward, args, kwargs):
        if self.running_fake:
            return forward(*args, **kwargs)
        check_traceable_module(m, self._name_of(m), self.source_file)  # torch.compile'd modules
        if id(m) not in self._first_names:   # known_modules() was read by _name_of
            return self._call_unowned(m, forward, args, kwargs)
        path = self.path_of_module(m)
        check_backward_hooks(m, path, lambda: caller_line(self.source_file))   # the line: only for an error
        if has_forward_hooks(m) and self.is_leaf_module(m, path):
            return self._call_hooked_leaf(m, path, args, kwargs)
        act = experts_activation(m)
        if act is not None:  # NOTE: Expert parallel (ops/experts.py): one node, in the module's scope
            forward = self._experts_forward(path, act, forward)
        return super().call_module(m, forward, args, kwargs)

    def _experts_forward(self, path: str, act: str, forward):
        def call(*args, **kwargs):
            out = traced_experts_call(self, path, act, args, kwargs)
            return forward(*args, **kwargs) if out is None else out
        return call

    def _call_hooked_leaf(self, m, path: str, args, kwargs):
        """A leaf with forward hooks: the hooks on traced values around its call_module node,
        all in the module's scope, as Module.__call__ runs them (NOTE: Module hooks)."""
        self.unhooked.setdefault(path, without_forward_hooks(m))

        def hooked(*args, **kwargs):
            return run_forward_hooks(m, lambda *a, **k: self.create_proxy("call_module", path, a, k),
                                     args, kwargs)
        self._hooks_traced = m  # fx's call_module then scopes `hooked` as a module's forward
        try:
            return super().call_module(m, hooked, args, kwargs)
        finally:
            self._hooks_traced = None

    def known_modules(self):
        if self._modules_seen is None:
            self._modules_seen = [sub for _, sub in self.trace_root.named_modules(remove_duplicate=False)]
            # each module's first name, looked up once per call_module (not a walk of the tree)
            self._first_names = {}
            for name, sub in self.trace_root.named_modules():
                self._first_names.setdefault(id(sub), name)
        return self._modules_seen

    def _name_of(self, m: torch.nn.Module) -> str:
        self.known_modules()
        return self._first_names.get(id(m), type(m).__name__)

    def _call_unowned(self, m, forward, args, kwargs):
        """A module built inside a forward (BERT's `CrossEntropyLoss()` in its forward): traced
        through, like the functional it calls, when it holds no state to train or keep."""
        state = [n for n, _ in list(m.named_parameters()) + list(m.named_buffers())]
        if state:
            raise GraphcError(
                f"build() calls a {type(m).__name__} at {caller_line(self.source_file)} that was "
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
        with self.untraced():
            return cpu_fake(self.fake_mode, t, self.stand_ins, self.fake_parameters)

    @contextlib.contextmanager
    def untraced(self):
        """graphc's own work on values while tracing: nothing in it is recorded (running_fake)."""
        before, self.running_fake = self.running_fake, True
        try:
            yield
        finally:
            self.running_fake = before

    def node_fake(self, node: fx.Node):
        """The value of `node` while tracing, None where unknown."""
        return node.meta.get(FAKE)

    def fake_of(self, proxy: fx.Proxy):
        node = proxy.node
        if FAKE not in node.meta:
            why = self.failed.get(node.name, "it is not a tensor graphc can follow")
            raise GraphcError(
                f"build() asks for the shape of '{node.name}' ({node.format_node()}), but graphc "
                f"could not compute its value while tracing: {why}. Fix: check the op's inputs "
                "(shapes, dtypes) at that line.")
        return node.meta[FAKE]

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if not node.stack_trace:   # fx's record_stack_traces, cheaper (NOTE: Recorded user lines)
            trace = user_stack_trace(sys._getframe(1))
            if trace:
                node.stack_trace = trace
        return node

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
                node.meta[FAKE] = self.examples[index]
            return proxy
        if kind == "call_method" and target == "backward":
            return proxy
        if kind == "call_method" and writes_in_place(target) and args:
            self._check_parameter_write(node, target)
        try:
            node.meta[FAKE] = self._run_fake(kind, target, args, kwargs)
        except GraphcError:
            raise
        except DynamicOutputShapeException as e:
            raise GraphcError(_data_dependent_shape(node, e)) from e
        except Exception as e:  # the value stays unknown; propagate_shapes reports the failure
            self.failed[node.name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return proxy

    def _check_parameter_write(self, node: fx.Node, op: str) -> None:
        """A write into a parameter (`model.w.mul_(0.9)`, also through `.data` or detach) is
        refused (NOTE: Tensors outside the trace)."""
        written = node.args[0]
        while isinstance(written, fx.Node) and (
                (written.op == "call_method" and written.target == "detach")
                or (written.op == "call_function" and written.target is getattr and written.args[1] == "data")):
            written = written.args[0]
        if isinstance(written, fx.Node) and written.op == "get_attr":
            try:
                with self.untraced():  # fx's patched getattr would give a proxy, not the Parameter
                    self.trace_root.get_parameter(written.target)
            except AttributeError:
                return
            where = deepest_user_frame(None, live_frames())
            raise refuse_parameter_write(written.target, op, where)

    def _run_fake(self, kind, target, args, kwargs):
        fargs = fx.node.map_aggregate(args, self._fake_arg)
        fkwargs = fx.node.map_aggregate(kwargs, self._fake_arg)
        with self.untraced(), self.fake_mode, frames_unobserved():
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
            if FAKE not in a.meta:
                raise RuntimeError(f"the value of '{a.name}' is unknown")
            return a.meta[FAKE]
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
            module = self.unhooked.get(target) or self.trace_root.get_submodule(target)
            return run_module_on_fakes(module, fargs, fkwargs, self.fake_tensor)
        finally:
            self.running_fake = False


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


def _data_dependent_shape(node: fx.Node, e: Exception) -> str:
    """Why an op whose result's shape depends on the data (nonzero, torch.where(cond),
    masked_select, unique, x[bool_mask]) cannot be in a plan, and the static forms."""
    op = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    where = deepest_user_frame(None, live_frames())
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
