"""Placements (which ranks hold a tensor), SBP values (how it is laid out on them), and a
Layout: the two together."""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

from .errors import GraphcError

DEVICE_TYPES = ("cpu", "cuda")


# A mesh is the `ranks` of a placement: a flat tuple (1-D) or a tuple of equal rows (2-D).
# These two are the one home of that shape; the rest of the mesh helpers are in sbp/layout.py.
def mesh_shape(mesh: tuple) -> Tuple[int, ...]:
    if mesh and isinstance(mesh[0], tuple):
        return (len(mesh), len(mesh[0]))
    return (len(mesh),)


def flat(mesh: tuple) -> Tuple[int, ...]:
    """Every rank of `mesh`, in mesh order (row by row)."""
    if mesh and isinstance(mesh[0], tuple):
        return tuple(r for row in mesh for r in row)
    return tuple(mesh)


@dataclass(frozen=True)
class placement:
    """The ranks a tensor or a stage lives on.

    Args:
        type: "cpu" or "cuda".
        ranks: global ranks, a flat list (1-D) or a list of equal-length lists (2-D mesh).

    Example:
        >>> graphc.placement("cpu", ranks=[0, 1])
        placement(type="cpu", ranks=[0, 1])
    """

    type: str
    ranks: tuple

    def __init__(self, type: str = "cpu", ranks: Sequence = (0,)):
        if type not in DEVICE_TYPES:
            raise GraphcError(
                f"placement type must be one of {DEVICE_TYPES}, found {type!r}; "
                "use graphc.placement(\"cpu\", ranks=[...]) or \"cuda\"")
        object.__setattr__(self, "type", type)
        object.__setattr__(self, "ranks", _freeze_ranks(ranks))

    @functools.cached_property   # read per node by several passes; a placement never changes
    def flat_ranks(self) -> Tuple[int, ...]:
        """All ranks in mesh order."""
        return flat(self.ranks)

    @property
    def ndim(self) -> int:
        return len(mesh_shape(self.ranks))

    @property
    def size(self) -> int:
        return len(self.flat_ranks)

    def __repr__(self) -> str:
        return f'placement(type="{self.type}", ranks={_ranks_list(self.ranks)})'


def _freeze_ranks(ranks) -> tuple:
    if _is_int(ranks):
        ranks = [ranks]
    if not isinstance(ranks, (list, tuple, range)):
        raise GraphcError(f"placement ranks must be a list of ints (or a list of equal rows for a "
                          f"2-D mesh), found {type(ranks).__name__} {ranks!r}. Fix: e.g. "
                          "graphc.placement(\"cpu\", ranks=[0, 1]).")
    ranks = list(ranks)
    if not ranks:
        raise GraphcError("placement needs at least one rank, found ranks=[]")
    if all(isinstance(r, (list, tuple)) for r in ranks):
        rows = [tuple(_rank(r, ranks) for r in row) for row in ranks]
        if len({len(row) for row in rows}) != 1:
            raise GraphcError(f"a 2-D placement needs rows of equal length, found {ranks}")
        flat = [r for row in rows for r in row]
        frozen = tuple(rows)
    else:
        flat = [_rank(r, ranks) for r in ranks]
        frozen = tuple(flat)
    if len(set(flat)) != len(flat):
        raise GraphcError(f"placement ranks must be distinct, found {ranks}")
    if any(r < 0 for r in flat):
        raise GraphcError(f"placement ranks must be >= 0, found {ranks}")
    return frozen


def _is_int(value) -> bool:
    """An integer (int, numpy or 0-d integer tensor) that is not a bool."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _rank(r, ranks) -> int:
    if not _is_int(r):  # int(True) == 1 and int(0.5) == 0 would pick a rank silently
        raise GraphcError(f"placement ranks must be ints, found {r!r} ({type(r).__name__}) in "
                          f"ranks={ranks!r}. Fix: give global rank numbers, e.g. ranks=[0, 1].")
    return operator.index(r)


def _ranks_list(ranks: tuple):
    return [list(r) if isinstance(r, tuple) else r for r in ranks]


class _SbpBase:
    __slots__ = ()


@dataclass(frozen=True, repr=False)
class Split(_SbpBase):
    """The tensor is cut into equal pieces along `dim`, one per rank."""

    dim: int

    def __repr__(self) -> str:
        return f"split({self.dim})"


@dataclass(frozen=True, repr=False)
class Broadcast(_SbpBase):
    """Every rank holds the full tensor."""

    def __repr__(self) -> str:
        return "broadcast"


@dataclass(frozen=True, repr=False)
class PartialSum(_SbpBase):
    """The full tensor is the sum of the ranks' components."""

    def __repr__(self) -> str:
        return "partial_sum"


class _SbpNamespace:
    """`graphc.sbp`: split(dim), broadcast, partial_sum."""

    Split = Split
    Broadcast = Broadcast
    PartialSum = PartialSum
    broadcast = Broadcast()
    partial_sum = PartialSum()

    @staticmethod
    def split(dim: int = 0) -> Split:
        if not _is_int(dim):  # split(True) would mean split(1)
            raise GraphcError(f"sbp.split(dim) needs an int dim, found {dim!r} "
                              f"({type(dim).__name__}). Fix: e.g. sbp.split(0) to split the "
                              "first dim, sbp.split(-1) the last.")
        return Split(operator.index(dim))


sbp = _SbpNamespace()


def normalize_sbp(value, ndim: int | None = None, where: str = "tensor") -> tuple:
    """Returns a tuple of SBP values (one per mesh axis), negative split dims normalised."""
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    out = []
    for v in values:
        if not isinstance(v, _SbpBase):
            raise GraphcError(
                f"{where}: sbp must be graphc.sbp.split(d), sbp.broadcast or sbp.partial_sum, "
                f"found {v!r}")
        if isinstance(v, Split) and ndim == 0:
            raise GraphcError(
                f"{where}: {v} cannot lay out a 0-d tensor (a scalar has no dim to split). "
                "Fix: use sbp.broadcast (every rank holds the value) or sbp.partial_sum.")
        if isinstance(v, Split) and ndim is not None:
            if not -ndim <= v.dim < ndim:
                raise GraphcError(
                    f"{where}: split({v.dim}) is out of range for a tensor with {ndim} dims; "
                    f"use a dim in [{-ndim}, {ndim - 1}]")
            v = Split(v.dim % ndim)
        out.append(v)
    return tuple(out)


@dataclass(frozen=True)
class Layout:
    """Where a global value lies and how: its placement and one SBP per mesh axis (what
    `to_global` declares for a parameter, a GlobalTensor input carries, a traced to_global
    converts to).

    Example:
        >>> Layout(graphc.placement("cpu", [0, 1]), (sbp.split(0),)).sbp
        (split(0),)
    """

    placement: "placement"
    sbp: tuple

    @staticmethod
    def of(value: Any) -> Optional["Layout"]:
        """A Layout as itself, a (placement, sbp) pair as a Layout (compile()'s callers may pass
        either), None as None."""
        if value is None or isinstance(value, Layout):
            return value
        where, sbp_ = value
        return Layout(where, sbp_)

    # Positional reads (layout[0], layout[1]) are kept only for passes/decompose_modules.py,
    # edited elsewhere now (issue 20): remove once it reads .placement and .sbp.
    def __getitem__(self, index: int):
        return (self.placement, self.sbp)[index]
