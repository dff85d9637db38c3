"""GlobalTensor and graphc.to_global."""
from __future__ import annotations

import os
import weakref
from typing import Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from . import world
from .block import ModuleBlock
from .errors import GraphcError
from .placement import Broadcast, Layout, PartialSum, Split, normalize_sbp
from .placement import placement as Placement
from .sbp.declared import conversion_target, encode_sbp, to_global_op
from .sbp.layout import local_shape


class GlobalTensor:
    """A tensor laid out over a placement with an SBP; this rank holds `to_local()`.

    Example:
        x = graphc.to_global(torch.randn(8, 4), placement=P01, sbp=sbp.split(0))
        x.shape        # global shape, (16, 4) on 2 ranks
        x.to_local()   # this rank's (8, 4) shard
    """

    def __init__(self, local: torch.Tensor, placement: Placement, sbp, shape: Tuple[int, ...]):
        self._local = local
        self.placement = placement
        self.sbp = sbp if isinstance(sbp, tuple) else (sbp,)
        self.shape = torch.Size(shape)

    @property
    def layout(self) -> Layout:
        """Its placement and sbp together."""
        return Layout(self.placement, self.sbp)

    @property
    def dtype(self) -> torch.dtype:
        return self._local.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def to_local(self) -> torch.Tensor:
        """This rank's component; an empty tensor on a rank outside the placement."""
        return self._local

    def __repr__(self) -> str:
        sbp = self.sbp[0] if len(self.sbp) == 1 else self.sbp
        return (f"GlobalTensor(shape={list(self.shape)}, placement={self.placement}, sbp={sbp}, "
                f"local={self._local!r})")


def to_global(obj, placement: Placement, sbp, shape=None):
    """Declares where a module, parameter or tensor lives and how it is laid out.

    On an nn.Module: placement/sbp for all its parameters and buffers; returns the module.
    On an nn.Parameter or buffer: that tensor's placement/sbp; returns it unchanged.
    On a tensor outside build(): a GlobalTensor whose local component is the tensor.
    On a tensor inside build(): a conversion point in the traced graph.

    Args:
        shape: the global shape of a tensor outside build(), needed when a split dim does
            not divide evenly over the ranks (the local shapes then differ by rank; rank k
            holds chunk k of torch.chunk, see docs/sbp.md); by default the local shape times
            the ranks of each split axis.

    Example:
        x = graphc.to_global(torch.randn(10, 5).chunk(4)[rank], placement=P0123,
                             sbp=graphc.sbp.split(0), shape=(10, 5))   # 3, 3, 3, 1 rows
    """
    if not isinstance(placement, Placement):
        raise GraphcError(f"to_global needs placement=graphc.placement(...), found {placement!r}")
    if isinstance(obj, fx.Proxy):
        sbp_t = normalize_sbp(sbp, where="to_global inside build()")
        # plain data only: fx would turn dataclass arguments into constructor nodes
        return obj.tracer.create_proxy("call_function", to_global_op, (obj,),
                                       {"placement": (placement.type, placement.ranks),
                                        "sbp": encode_sbp(sbp_t)})
    if isinstance(obj, ModuleBlock):    # graph.model.sub, after assigning model to a Graph
        to_global(obj._module, placement=placement, sbp=sbp)
        return obj
    if isinstance(obj, nn.Module):
        for name, t in list(obj.named_parameters()) + list(obj.named_buffers()):
            where = f"to_global on {type(obj).__name__}, tensor '{name}' (shape {list(t.shape)})"
            _declare(t, placement, normalize_sbp(sbp, t.dim(), where), override=False)
        return obj
    if isinstance(obj, nn.Parameter):
        where = f"to_global on a parameter (shape {list(obj.shape)})"
        _declare(obj, placement, normalize_sbp(sbp, obj.dim(), where), override=True)
        return obj
    if isinstance(obj, GlobalTensor):
        obj = obj.to_local()
    if isinstance(obj, torch.Tensor):
        where = f"to_global on a tensor of shape {list(obj.shape)}"
        sbp_t = normalize_sbp(sbp, obj.dim(), where)
        if shape is not None:
            _check_local_shape(obj, placement, sbp_t, tuple(shape))
        return global_from_local(obj, placement, sbp_t, shape)
    raise GraphcError(f"to_global expects an nn.Module, a parameter or a tensor, found {type(obj).__name__}")


# id(tensor) -> (Layout, weak reference to the tensor, override): what
# to_global declared, until the tensor dies. The compiler never reads it: a Graph snapshots
# its parameters' entries when it compiles (Graph.declared_layouts, sbp/declared.py).
_DECLARED: dict = {}


def _declare(t: torch.Tensor, placement: Placement, sbp: tuple, override: bool) -> None:
    if any(isinstance(s, PartialSum) for s in sbp):
        raise GraphcError(
            f"to_global: a parameter or buffer (shape {list(t.shape)}) cannot be partial_sum; "
            "a model's state is whole (broadcast) or sharded. Fix: use sbp.broadcast or "
            "sbp.split(d) for parameters; partial_sum is for tensors inside build().")
    if len(sbp) != placement.ndim:
        raise GraphcError(
            f"to_global: a parameter or buffer (shape {list(t.shape)}) on the {placement.ndim}-D "
            f"{placement} needs {placement.ndim} sbp value(s), found {len(sbp)}. Fix: give one "
            "sbp per mesh axis, e.g. sbp=(sbp.broadcast, sbp.split(0)).")
    if id(t) not in _DECLARED:
        weakref.finalize(t, _DECLARED.pop, id(t), None)
    elif not override and _DECLARED[id(t)][2]:
        return   # a module's to_global keeps what to_global on the parameter itself said
    _DECLARED[id(t)] = (Layout(placement, sbp), weakref.ref(t), override)


def declared_layout(t: torch.Tensor) -> Optional[Layout]:
    """The Layout given by to_global for a parameter or buffer, or None."""
    entry = _DECLARED.get(id(t))
    if entry is None or entry[1]() is not t:
        return None
    return entry[0]


def global_from_local(local: torch.Tensor, placement: Placement, sbp: tuple, shape=None) -> GlobalTensor:
    """A GlobalTensor of global `shape` (default: the local shape times each split axis's ranks)."""
    if len(sbp) != placement.ndim:
        raise GraphcError(f"to_global: a {placement.ndim}-D placement needs {placement.ndim} sbp "
                          f"values, found {len(sbp)}: {sbp}")
    if shape is not None:
        return GlobalTensor(local, placement, sbp, tuple(shape))
    shape = list(local.shape)
    mesh = [len(placement.ranks)] if placement.ndim == 1 else [len(placement.ranks), len(placement.ranks[0])]
    for axis, s in enumerate(sbp):
        if isinstance(s, Split):
            shape[s.dim] *= mesh[axis]
    return GlobalTensor(local, placement, sbp, tuple(shape))


def _check_local_shape(local: torch.Tensor, placement: Placement, sbp: tuple, shape: tuple) -> None:
    """This rank's component must be its shard of `shape` (ranks outside pass any tensor)."""
    if len(shape) != local.dim():
        raise GraphcError(f"to_global: shape={list(shape)} has {len(shape)} dims, but the local "
                          f"tensor has {local.dim()} (shape {list(local.shape)}). Fix: pass the "
                          "global shape of the same tensor.")
    rank = _this_rank()
    if rank is None or rank not in placement.flat_ranks:
        return
    want = local_shape(shape, sbp, placement.ranks, rank)
    if tuple(local.shape) != want:
        raise GraphcError(
            f"to_global on rank {rank}: the local tensor has shape {list(local.shape)}, but rank "
            f"{rank}'s shard of a {list(shape)} tensor laid out as "
            f"{sbp[0] if len(sbp) == 1 else sbp} on {placement} is {list(want)} (rank k holds "
            "chunk k of torch.chunk along a split dim). Fix: pass this rank's chunk, "
            "t.chunk(n, dim)[k] of the whole tensor t, or the right global shape.")


def _this_rank():
    if world.current() is not None:
        return world.rank()
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None and rank.isdigit() else None


__all__ = ["GlobalTensor", "to_global", "declared_layout", "to_global_op",
           "global_from_local",
           "Split", "Broadcast", "PartialSum"]
