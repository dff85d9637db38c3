"""ZeRO stage 3's parameters between graph calls: a read is refused by name, never a crash.

NOTE: ZeRO-3 parameters between calls
Between graph calls a stage-3 parameter's whole storage is freed (resized to 0 bytes: NOTE:
ZeRO stage 3) while the tensor keeps its shape, so any read of it outside graphc
(`model.fc1.weight.clone()`, `print(...)`, `model.state_dict()`, `copy.deepcopy(model)`)
would read freed memory and crash the process. Gathering it on access cannot be right
either: a gather is collective, and a read on one rank (`if rank == 0: print(w)`) would
wait for its peers forever. So when a graph call (or state_dict(), load_state_dict(),
full_state_dict(), compile()) returns, every parameter of the graph's model that ZeRO stage
3 holds as rows and whose storage is freed becomes a HeldParameter (its class, nothing
else: the same object, still an nn.Parameter, its hooks and autograd state untouched),
whose __torch_function__ lets metadata through (shape, dtype, device, requires_grad, grad,
numel, ...) and raises a GraphcError naming the parameter, the user's line and the fixes
for anything that reads its values (or hands out a tensor sharing its freed storage:
`.data`, views). The next graph entry makes them plain nn.Parameters again before anything
runs, so a step pays nothing for this. A parameter of a Parameter subclass keeps its class.
"""
from __future__ import annotations

import os
import threading
import traceback
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Mapping, Optional, Tuple

import torch
from torch._C import _disabled_torch_function_impl

from ..errors import GraphcError
from .zero import any_held, released_in

_T = torch.Tensor
# what reads no values of a freed parameter and hands out no tensor sharing its storage
_METADATA = frozenset(
    [getattr(_T, name).__get__ for name in (
        "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "grad_fn", "ndim",
        "layout", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized",
        "_version", "itemsize", "nbytes", "_base")]
    + [_T.requires_grad.__set__, _T.grad.__set__]
    + [_T.size, _T.dim, _T.numel, _T.nelement, _T.stride, _T.element_size, _T.is_contiguous,
       _T.storage_offset, _T.untyped_storage, _T.data_ptr, _T.__len__, _T.get_device,
       _T.register_hook, _T.register_post_accumulate_grad_hook, _T.requires_grad_,
       _T.is_floating_point, _T.is_complex])

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_GRAPHC_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_PYTHON_DIR = os.path.dirname(os.__file__) + os.sep   # copy.deepcopy's frames and the like


class HeldParameter(torch.nn.Parameter):
    """A stage-3 parameter between graph calls (See NOTE: ZeRO-3 parameters between calls)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _METADATA:
            freed = _freed_among(args, kwargs)
            if freed is not None:
                raise _read_refused(freed, func)
            elsewhere = _elsewhere_among(func, args, kwargs)
            if elsewhere is not None:
                raise _elsewhere_refused(elsewhere, func)
        return _disabled_torch_function_impl(func, types, args, kwargs)


# NOTE: Parameters held elsewhere
# Between calls the user's model on a rank holds what the plans left there: on a pipeline,
# the parameters of stages other ranks run are the values the model started with (never
# trained here); under tensor parallelism a split parameter is this rank's part (its shape
# the part's). Code that reads the model between calls (a validation pass, a logged weight
# norm, an EMA teacher updated after each call) would read stale or partial values silently,
# on some ranks only. So such parameters are held as ZeRO-3's are (See NOTE: ZeRO-3
# parameters between calls): a read of their values is a GraphcError naming the parameter,
# the line and the fix; an in-place update of the parameter itself (every rank runs the
# same script, and the rank that holds it does the same) still runs.
_ELSEWHERE_SEEN = False


def hold_elsewhere(params: Mapping[str, Tuple[torch.nn.Parameter, str]]) -> None:
    """Marks each parameter (by name: the parameter and why this rank does not hold it whole)
    to be held between calls (See NOTE: Parameters held elsewhere); a parameter this rank
    now holds whole (a later plan's) is unmarked by `release_elsewhere`."""
    global _ELSEWHERE_SEEN
    for name, (p, why) in params.items():
        p._graphc_elsewhere = (name, why)
        _ELSEWHERE_SEEN = True


def release_elsewhere(params: Iterable[torch.nn.Parameter]) -> None:
    for p in params:
        if getattr(p, "_graphc_elsewhere", None) is not None:
            p._graphc_elsewhere = None


def _elsewhere_among(func, args, kwargs) -> Optional[torch.nn.Parameter]:
    name = getattr(func, "__name__", "")
    in_place = name.endswith("_") and not name.endswith("__")
    for i, a in enumerate((*args, *kwargs.values())):
        if type(a) is HeldParameter and getattr(a, "_graphc_elsewhere", None) is not None \
                and not (in_place and i == 0):
            return a
        if isinstance(a, (list, tuple)):
            found = _elsewhere_among(func, a, {})
            if found is not None:
                return found
    return None


def _elsewhere_refused(p: torch.nn.Parameter, func) -> GraphcError:
    name, why = p._graphc_elsewhere
    what = getattr(func, "__name__", None) or repr(func)
    if what == "__get__":
        what = "." + getattr(getattr(func, "__self__", None), "__name__", "attribute")
    return GraphcError(
        f"{_user_line()}: reads the parameter '{name}' ({what}) between graph calls, but {why}, so "
        "what this rank's model holds is not the trained parameter "
        "(See NOTE: Parameters held elsewhere). Fix: read the whole model with graph.full_state_dict() (collective: every rank "
        "calls it), compute it inside a graph (a validation loss: a forward-only Graph of the same "
        "model on the same stages), or update it in place (p.mul_(...), which every rank may run).")


def hold_between_calls(params: Iterable[torch.nn.Parameter]) -> None:
    """Each of `params` that ZeRO stage 3 holds as rows, its storage freed, becomes a
    HeldParameter until the next graph entry (zero.released_in: no walk of the parameters in
    a process that never held one, so the call of a graph without stage 3 pays nothing)."""
    params = list(params)
    for p in released_in(params):
        if type(p) is torch.nn.Parameter:
            p.__class__ = HeldParameter
    if _ELSEWHERE_SEEN:   # (See NOTE: Parameters held elsewhere)
        for p in params:
            if type(p) is torch.nn.Parameter and getattr(p, "_graphc_elsewhere", None) is not None:
                p.__class__ = HeldParameter


def release_hold(params: Iterable[torch.nn.Parameter]) -> None:
    """Every HeldParameter among `params` is a plain nn.Parameter again."""
    if not any_held() and not _ELSEWHERE_SEEN:
        return
    for p in params:
        if type(p) is HeldParameter:
            p.__class__ = torch.nn.Parameter


_DEPTH = threading.local()   # graph entries open on this thread (a local world's rank is one)


@contextmanager
def graph_entry(parameters: Callable[[], Iterable[torch.nn.Parameter]]) -> Iterator[None]:
    """Around a graph's public call: its model's parameters() plain inside, stage-3 ones freed
    between calls held after the outermost entry returns (one may call another: a checked
    step reads the state dict) (See NOTE: ZeRO-3 parameters between calls). parameters() is
    walked only in a process that has held stage-3 rows."""
    depth = getattr(_DEPTH, "n", 0)
    if depth == 0:
        release_hold(parameters())
    _DEPTH.n = depth + 1
    try:
        yield
    finally:
        _DEPTH.n = depth
        if depth == 0:
            hold_between_calls(parameters())


def _freed(p: torch.nn.Parameter) -> bool:
    shard = getattr(p, "_graphc_zero3", None)   # set by ZeroShards.from_plan (runtime/zero.py)
    if shard is None:
        return False
    with torch._C.DisableTorchFunctionSubclass():
        return shard.released


def _freed_among(args, kwargs) -> Optional[HeldParameter]:
    for a in (*args, *kwargs.values()):
        if type(a) is HeldParameter and _freed(a):
            return a
        if isinstance(a, (list, tuple)):
            found = _freed_among(a, {})
            if found is not None:
                return found
    return None


def _read_refused(p: HeldParameter, func) -> GraphcError:
    name = p._graphc_zero3.name
    what = getattr(func, "__name__", None) or repr(func)
    if what == "__get__":   # a property: Tensor.data
        what = "." + getattr(getattr(func, "__self__", None), "__name__", "attribute")
    return GraphcError(
        f"{_user_line()}: reads the parameter '{name}' ({what}) between graph calls, but "
        f"config.enable_zero(stage=3) holds it as this rank's rows there: its whole storage is "
        "freed until the next call gathers it (reading it would read freed memory). Fix: read the "
        "whole model with graph.full_state_dict() (collective: every rank calls it) or this "
        "rank's part with graph.state_dict(), read it inside build(), or use "
        "enable_zero(stage=2), which keeps parameters whole between calls.")


def _user_line() -> str:
    """'file:line: code' of the deepest frame outside torch and graphc."""
    frames = [f for f in traceback.extract_stack()
              if not f.filename.startswith((_TORCH_DIR, _GRAPHC_DIR, _PYTHON_DIR))]
    if not frames:
        return "(no user frame)"
    f = frames[-1]
    return f"{f.filename}:{f.lineno}: {f.line}"
