"""Real tensors that build() reaches while it traces, made graph values (`traced_tensors`).

NOTE: Tensors outside the trace
fx records an op only when one of its arguments is a proxy; an op on real tensors runs
once, while tracing, and its result enters the graph as a constant. Two kinds of real
tensor make that differ from eager, where the op runs on every call:
- parameters and buffers reached other than as a module attribute (`model.parameters()`,
  `named_parameters()`, `state_dict()`, a list of parameters kept on the Graph): an L2
  penalty or a logged weight norm over them would be frozen at its value when traced
  (and its autograd graph backed through twice). While tracing, a torch function mode
  (TracedTensors) puts the parameter's get_attr node in place of the tensor, as fx does
  for `model.a.weight`; an alias that shares its memory (`p.data`, a state_dict entry) is
  the same node detached;
- a tensor build() makes without traced inputs (`torch.zeros(n)`) and then writes into
  in place with a traced value (`buf.add_(x.sum(0))`, `.scatter_add_(0, idx, src)`,
  `buf[i] = v`): the write would land in the graph's constant and accumulate over steps.
  The write goes to a copy of the constant made on every call (a `clone` node), and every
  later use of the tensor reads the written node. A random draw into such a tensor
  (`torch.empty(size).bernoulli_(p)`, torchvision's stochastic_depth) is recorded the same
  way, though nothing traced flows into it: otherwise its mask would be frozen for every step.
A write into a parameter inside build() (an EMA teacher's `p_t.mul_(0.99)` under no_grad)
would run per micro-batch, or at trace time only, never once per step as in eager: it is
refused with the user's line and the fix (update after the graph call). Buffers reached
any way stay writable in place, as buffers reached as attributes are.
"""
from __future__ import annotations

import operator
import sys
from contextlib import contextmanager
from typing import Dict, Optional, Tuple

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

from ..errors import GraphcError
from ..ops.random_ops import RANDOM_METHODS
from .user_lines import TORCH_DIR, deepest_user_frame, live_frames

# Python's operators on a tensor, recorded as the operator (fx's own form for a proxy)
_OPERATORS = {
    "__add__": operator.add, "__radd__": lambda a, b: b + a,
    "__sub__": operator.sub, "__rsub__": lambda a, b: b - a,
    "__mul__": operator.mul, "__rmul__": lambda a, b: b * a,
    "__truediv__": operator.truediv, "__rtruediv__": lambda a, b: b / a,
    "__floordiv__": operator.floordiv, "__rfloordiv__": lambda a, b: b // a,
    "__mod__": operator.mod, "__pow__": operator.pow, "__rpow__": lambda a, b: b ** a,
    "__matmul__": operator.matmul, "__rmatmul__": lambda a, b: b @ a,
    "__neg__": operator.neg, "__abs__": operator.abs, "__getitem__": operator.getitem,
    "__lt__": operator.lt, "__le__": operator.le, "__gt__": operator.gt, "__ge__": operator.ge,
    "__eq__": operator.eq, "__ne__": operator.ne, "__and__": operator.and_, "__or__": operator.or_,
    "__invert__": operator.invert,
}
# Python's in-place operators, recorded as the tensor method they are
IN_PLACE_OPERATORS = {"__iadd__": "add_", "__isub__": "sub_", "__imul__": "mul_",
                      "__itruediv__": "div_", "__ifloordiv__": "floor_divide_", "__imod__": "remainder_",
                      "__ipow__": "pow_", "__iand__": "bitwise_and_", "__ior__": "bitwise_or_",
                      "__ixor__": "bitwise_xor_"}
# factories whose values are unset: made zero while tracing, so a constant is the same every trace
_UNSET = frozenset({"empty", "empty_like", "new_empty", "empty_strided"})
# methods ending in "_" that set flags, not values
_NOT_WRITES = frozenset({"requires_grad_", "retain_grad", "share_memory_", "detach_",
                         "resize_", "set_", "record_stream", "pin_memory", "backward"})
# questions about a tensor's shape and kind: answered by the real tensor, never recorded
_QUESTIONS = frozenset({"size", "dim", "ndimension", "numel", "nelement", "element_size",
                        "is_floating_point", "is_complex", "get_device", "is_contiguous",
                        "data_ptr", "untyped_storage", "storage_offset", "stride", "type",
                        "is_leaf", "tolist", "item", "__len__", "__repr__", "__format__",
                        "__hash__", "__bool__", "__index__", "__int__", "__float__"})


def writes_in_place(name: str) -> bool:
    """Does the op named `name` (a tensor method or Python operator) write into its first argument?"""
    if name in IN_PLACE_OPERATORS or name == "__setitem__":
        return True
    return name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES


def refuse_parameter_write(name: str, op: str, where: str) -> GraphcError:
    return GraphcError(
        f"build() writes into the parameter '{name}' in place ({op}) at {where}. build() is "
        "traced into a graph that runs once per micro-batch, so the write would not happen "
        "once per step as in eager (an EMA teacher would move once per micro-batch, or only "
        "while tracing). Fix: update it after the graph call, outside build(): "
        "`loss = graph(x, y); with torch.no_grad(): for p_t, p_s in zip(teacher.parameters(), "
        "student.parameters()): p_t.mul_(0.99).add_(p_s, alpha=0.01)`.")


def refuse_grad_read(name: str, where: str) -> GraphcError:
    """A gradient read inside build() (`p.grad`): while tracing there is none, and the plan runs
    build() per micro-batch on each rank's shards, so no value the trace could read is eager's
    gradient of the step."""
    return GraphcError(
        f"build() reads the gradient of '{name}' (.grad) at {where}: build() is traced before any "
        "step runs and then runs once per micro-batch, on each rank's part of the batch and of the "
        "weights, so the gradient it would read (or scale, or clip) is not eager's gradient of the "
        "step. Fix: clip with self.config.set_grad_clip_norm(max_norm); scale the loss instead of "
        "the gradients; to log or change the step's whole gradient use "
        "param.register_post_accumulate_grad_hook(fn), which runs once per step.")


class TracedTensors(TorchFunctionMode):
    """While tracing: parameters and buffers as their get_attr nodes, and in-place writes
    into tensors made while tracing as writes into a per-call copy (See NOTE: Tensors
    outside the trace)."""

    def __init__(self, tracer):
        super().__init__()
        self.tracer = tracer
        root = tracer.trace_root
        self.params = {id(p): (n, p) for n, p in root.named_parameters()}
        self.buffers = {id(b): (n, b) for n, b in root.named_buffers()}
        self.memory = {_memory_key(t): n for n, t in list(root.named_parameters()) + list(root.named_buffers())
                       if _memory_key(t) is not None}
        self.param_storages = {_storage(p): n for n, p in root.named_parameters() if _storage(p) is not None}
        self.owned_storages = set(self.param_storages) | {_storage(b) for b in root.buffers()}
        self.made: Dict[int, torch.Tensor] = {}     # id -> a real tensor an op made while tracing
        self.written: Dict[int, fx.Proxy] = {}      # id of such a tensor -> the node it now reads
        self.nodes: Dict[Tuple[str, bool], fx.Proxy] = {}
        self.stale: Dict[int, Tuple[str, int]] = {}  # id of a tensor sharing a written one's memory -> (the write's line, its id)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.tracer.running_fake:  # graphc's own work on fakes
            return func(*args, **kwargs)
        if _untraced(name):  # a question, a property, torch's internals: run as they are
            if name.startswith("_foreach_") and name.endswith("_") and args:
                for t in args[0]:  # torch._foreach_mul_(teacher_params, 0.99)
                    self._check_parameter_write(t, name)
            if name == "__set__" and getattr(getattr(func, "__self__", None), "__name__", "") == "data" and args:
                self._check_parameter_write(args[0], ".data =")  # p_t.data = 0.99 * p_t.data + ...
            if name in ("__get__", "__set__") and getattr(getattr(func, "__self__", None), "__name__", "") == "grad" \
                    and args and id(args[0]) in self.params and _called_by_user():
                # p.grad of a parameter reached any way (torch's own zero_grad() may ask)
                raise refuse_grad_read(self.params[id(args[0])][0], _user_line())
            return self._made_by(func, args, kwargs)
        if name == "__setitem__":
            self._stored_back(args)
        written = writes_in_place(name) and args and isinstance(args[0], torch.Tensor) \
            and not isinstance(args[0], fx.Proxy)
        if written:
            self._check_parameter_write(args[0], name)
            self._check_held_write(args[0], name)
        targs, tkwargs = fx.node.map_aggregate((tuple(args), kwargs), self._traced)
        # a draw into a tensor made while tracing (torchvision's stochastic_depth:
        # `torch.empty(size).bernoulli_(p)`) would be one mask frozen for every step
        drawn = name in RANDOM_METHODS and args and id(args[0]) in self.made and not isinstance(targs[0], fx.Proxy)
        if not _has_proxy((targs, tkwargs)) and not drawn:
            return self._made_by(func, args, kwargs)
        _check_out(name, kwargs)
        if drawn and not written:   # t.bernoulli(): drawn from a per-call copy as well
            targs = (self.tracer.create_proxy("call_method", "clone", (args[0],), {}),) + tuple(targs[1:])
        if written and id(args[0]) in self.made and id(args[0]) not in self.written:
            # the first traced write into a tensor made while tracing: into a per-call copy
            self._note_stale_views(args[0])
            copy = self.tracer.create_proxy("call_method", "clone", (args[0],), {})
            targs = (copy,) + tuple(targs[1:])
        out = _record(func, name, targs, tkwargs)
        if written and id(args[0]) in self.made:
            self.written[id(args[0])] = targs[0] if name == "__setitem__" else out
        return out

    def _made_by(self, func, args, kwargs):
        out = func(*args, **kwargs)
        if getattr(func, "__name__", "") in _UNSET and isinstance(out, torch.Tensor) \
                and not isinstance(out, (fx.Proxy, torch._subclasses.FakeTensor)):
            out.zero_()   # what memory it held is no value of the program (GRAPHC_RETRACE compares constants)
        self._note_made(out)
        return out

    def _stored_back(self, args) -> None:
        """`buf[i] += v` writes into the view buf[i], then stores it back into buf whole: buf
        is not a stale read then."""
        stale = self.stale.get(id(args[0]))
        if stale is not None and len(args) == 3 and args[2] is self.written.get(stale[1]):
            del self.stale[id(args[0])]

    def _traced(self, a):
        if not isinstance(a, torch.Tensor) or isinstance(a, (fx.Proxy, torch._subclasses.FakeTensor)):
            return a
        if id(a) in self.stale:
            raise GraphcError(
                f"build() reads a tensor at {_user_line()} that shares memory with a tensor it "
                f"wrote in place at {self.stale[id(a)][0]} (a view of it, or the tensor it is a view "
                "of). In eager the read sees the write; graphc writes into a copy made on every "
                "call. Fix: take the view after the write, or write into the tensor itself.")
        if id(a) in self.written:
            return self.written[id(a)]
        known = self.params.get(id(a)) or self.buffers.get(id(a))
        if known is not None:
            return self._attribute(known[0], detached=False)
        alias = self.memory.get(_memory_key(a))
        if alias is not None:  # p.data, a state_dict() entry: the parameter, detached
            return self._attribute(alias, detached=True)
        return a

    def _attribute(self, target: str, detached: bool) -> fx.Proxy:
        key = (target, detached)
        if key not in self.nodes:
            node = self.tracer.create_proxy("get_attr", target, (), {})
            self.nodes[key] = self.tracer.create_proxy("call_method", "detach", (node,), {}) if detached else node
        return self.nodes[key]

    def _note_made(self, out) -> None:
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and not isinstance(t, (fx.Proxy, torch._subclasses.FakeTensor)) \
                    and _storage(t) not in self.owned_storages:  # a view of a parameter is not made here
                self.made[id(t)] = t  # kept alive while tracing: the id stays this tensor's

    def _note_stale_views(self, t: torch.Tensor) -> None:
        """Made tensors sharing t's memory would see its write in eager, not here: a later
        read of one is refused."""
        storage = _storage(t)
        if storage is None:
            return
        where = _user_line()
        for other in self.made.values():
            if other is not t and id(other) not in self.written and _storage(other) == storage:
                self.stale[id(other)] = (where, id(t))

    def _check_held_write(self, t: torch.Tensor, op: str) -> None:
        """A write into a tensor build() neither made nor owns as a parameter or buffer (a
        plain tensor attribute, a global) would run per trace or per micro-batch, not per call."""
        if isinstance(t, torch._subclasses.FakeTensor) or id(t) in self.made or id(t) in self.buffers \
                or self.memory.get(_memory_key(t)) is not None:
            return
        raise GraphcError(
            f"build() writes in place ({IN_PLACE_OPERATORS.get(op, op)}) into a tensor of shape "
            f"{list(t.shape)} that it did not make and that is no parameter or buffer of the "
            f"Graph's modules (a plain tensor attribute, a global) at {_user_line()}. graphc "
            "records build() once, so the write would not happen once per call as in eager. "
            "Fix: register it as a buffer of a module assigned to the Graph "
            "(module.register_buffer('name', t)), or update it outside build().")

    def _check_parameter_write(self, t, op: str) -> None:
        if not isinstance(t, torch.Tensor) or isinstance(t, (fx.Proxy, torch._subclasses.FakeTensor)):
            return
        name = self.params[id(t)][0] if id(t) in self.params else self.param_storages.get(_storage(t))
        if name is not None:
            raise refuse_parameter_write(name, IN_PLACE_OPERATORS.get(op, op), _user_line())


def _untraced(name: str) -> bool:
    if name in ("__get__", "__set__") or name in _QUESTIONS:
        return True
    return name.startswith("_") and name not in _OPERATORS and name not in IN_PLACE_OPERATORS \
        and name != "__setitem__"


def _check_out(name: str, kwargs) -> None:
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor) and not isinstance(out, fx.Proxy):
        raise GraphcError(
            f"build() calls {name}(..., out=...) with traced inputs at {_user_line()}: the "
            "result would be written into a tensor held outside the graph, once per "
            "micro-batch, not into the variable on every call. Fix: assign the result "
            f"(`buf = torch.{name}(...)`).")


def _record(func, name: str, args, kwargs):
    """The op on traced arguments, recorded by the proxy as fx records it."""
    if name == "__setitem__":
        args[0][args[1]] = args[2]  # NOTE: Item writes (traced_writes.py)
        return None
    if name in IN_PLACE_OPERATORS:
        func, name = getattr(torch.Tensor, IN_PLACE_OPERATORS[name]), IN_PLACE_OPERATORS[name]
    if name in _OPERATORS and isinstance(args[0], fx.Proxy):
        return _OPERATORS[name](*args)
    proxy = next(p for p in _proxies((args, kwargs)))
    return type(proxy).__torch_function__(func, (type(proxy),), args, kwargs)


def _called_by_user() -> bool:
    """Is the code that made the call running now (the frame below this mode's) the user's,
    not torch's own (Module.zero_grad reading p.grad)?"""
    frame = sys._getframe(2)   # _called_by_user <- __torch_function__ <- the caller
    return not frame.f_code.co_filename.startswith(TORCH_DIR)


def _user_line() -> str:
    return deepest_user_frame(None, live_frames())


def _proxies(tree):
    found = []
    fx.node.map_aggregate(tree, lambda a: found.append(a) if isinstance(a, fx.Proxy) else a)
    return found


def _has_proxy(tree) -> bool:
    return bool(_proxies(tree))


def _memory_key(t: torch.Tensor) -> Optional[tuple]:
    if t.device.type == "meta" or isinstance(t, torch._subclasses.FakeTensor) or not t.data_ptr():
        return None  # no memory to share (an empty tensor's pointer is 0)
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device)


def _storage(t: torch.Tensor) -> Optional[int]:
    if t.device.type == "meta" or isinstance(t, torch._subclasses.FakeTensor):
        return None
    return t.untyped_storage().data_ptr() or None


@contextmanager
def traced_tensors(tracer):
    """While active, build()'s real parameters, buffers and made tensors trace as graph values."""
    with TracedTensors(tracer):
        yield
