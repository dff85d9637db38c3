"""Meshes and layouts: which ranks hold a value and how its global shape maps to local shards.

The mesh helpers (mesh_shape and flat from placement.py, same_shape, axis_groups,
joint_groups, coord, stage_meshes) and the shard arithmetic all live here.

A mesh is the `ranks` of a placement: a flat tuple (1-D) or a tuple of equal rows (2-D).
An nd-SBP is a tuple with one SBP value per mesh axis. Axis 0 of a 2-D mesh indexes rows,
axis 1 columns; when two axes split the same tensor dim, axis 0 splits first (outer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Sequence, Tuple

import torch

from ..errors import GraphcError
from ..placement import Broadcast, PartialSum, Split, flat, mesh_shape  # noqa: F401 (the mesh vocabulary)

B = Broadcast()
P = PartialSum()
S = Split


def same_shape(a: tuple, b: tuple) -> bool:
    """Do two meshes have the same shape? Only then does a layout carry over axis by axis
    between their stages (replica k to replica k); otherwise a value crosses whole."""
    return mesh_shape(a) == mesh_shape(b)


def axis_groups(mesh: tuple, axis: int) -> Tuple[Tuple[int, ...], ...]:
    """The rank groups that talk along mesh `axis` (one group per position on the other axes)."""
    if not (mesh and isinstance(mesh[0], tuple)):
        return (tuple(mesh),)
    rows = [tuple(row) for row in mesh]
    if axis == 1:
        return tuple(rows)
    return tuple(tuple(row[c] for row in rows) for c in range(len(rows[0])))


def joint_groups(mesh: tuple, axes: Sequence[int]) -> Tuple[Tuple[int, ...], ...]:
    """The rank groups that talk along all of `axes` together (the flattened group of those
    axes, torchtitan's dp_shard x cp): the ranks at one position on the other axes, sorted
    (the order ZeRO's shards take rows in). One axis's are axis_groups'."""
    if len(axes) == 1:
        return axis_groups(mesh, axes[0])
    if mesh and isinstance(mesh[0], tuple):
        at = [((i, j), r) for i, row in enumerate(mesh) for j, r in enumerate(row)]
    else:
        at = [((j,), r) for j, r in enumerate(mesh)]
    groups: dict = {}
    for c, r in at:
        groups.setdefault(tuple(x for i, x in enumerate(c) if i not in axes), []).append(r)
    return tuple(tuple(sorted(g)) for g in groups.values())


def coord(mesh: tuple, rank: int) -> Tuple[int, ...]:
    """This rank's index along every mesh axis."""
    if mesh and isinstance(mesh[0], tuple):
        for i, row in enumerate(mesh):
            if rank in row:
                return (i, row.index(rank))
    return (tuple(mesh).index(rank),)


def stage_meshes(stages, placements: Iterable) -> List[tuple]:
    """One mesh per stage: the ranks of the first 2-D placement naming exactly the stage's
    ranks (set_stage, to_global on parameters or inputs), else the stage's flat ranks."""
    # each distinct 2-D placement once, with its ranks sorted (thousands of parameters share a few)
    grids = [(p, sorted(p.flat_ranks)) for p in dict.fromkeys(p for p in placements if p is not None)
             if p.ndim == 2]
    meshes = []
    for st in stages:
        mesh = tuple(st.ranks)
        ranks = sorted(st.ranks)
        for p, its_ranks in grids:
            if its_ranks == ranks:
                if isinstance(mesh[0], tuple) and mesh != p.ranks:
                    raise GraphcError(
                        f"stage {st.stage_id} is given two 2-D meshes, {mesh} and {p.ranks}; "
                        "use one 2-D placement for all tensors of a stage")
                mesh = p.ranks
        meshes.append(mesh)
    return meshes


# A split dim need not divide over its ranks: it is cut as torch.chunk cuts it, as DTensor's
# Shard does (See NOTE: Uneven splits, docs/sbp.md). These helpers are the one home of that
# arithmetic.


def chunk_sizes(size: int, n: int) -> Tuple[int, ...]:
    """The n shard sizes of a dim of `size` (See NOTE: Uneven splits)."""
    c = -(-size // n)
    return tuple(max(0, min(c, size - k * c)) for k in range(n))


def chunk_range(size: int, n: int, k: int) -> Tuple[int, int]:
    """(start, length) of shard k of n of a dim of `size`."""
    c = -(-size // n)
    start = min(size, k * c)
    return start, min(c, size - start)


# NOTE: Zig-zag dealing
# With set_context_parallel(load_balance=True) a sequence split over n ranks is cut into 2n
# equal chunks and rank k holds chunks k and 2n-1-k, in that order (Megatron's and
# torchtitan's load balancing): under a causal mask every rank then sees the same number of
# (query, key) chunk pairs. The split value's global order is unchanged; only which
# positions a rank holds differs, so its local shape is the contiguous split's (the dim must
# divide by 2n). These helpers are the one home of that dealing (See NOTE: Context parallel).


def zigzag_pieces(size: int, n: int, k: int) -> Tuple[Tuple[int, int], ...]:
    """(start, length) of each chunk rank k holds, in local order (See NOTE: Zig-zag dealing)."""
    c = size // (2 * n)
    return ((k * c, c), ((2 * n - 1 - k) * c, c))


def zigzag_order(size: int, n: int) -> List[int]:
    """The global positions of the ranks' local rows, rank 0's first: a dim gathered from
    zig-zag shards holds global row zigzag_order[i] at row i (See NOTE: Zig-zag dealing)."""
    return [i for k in range(n) for start, length in zigzag_pieces(size, n, k)
            for i in range(start, start + length)]


def _zero_coord(mesh: tuple) -> Tuple[int, ...]:
    return (0,) * len(mesh_shape(mesh))


def _shard_box(shape: Sequence[int], sbp: tuple, mesh: tuple, at: Sequence[int], upto=None):
    """(starts, sizes) of the shard at mesh coordinate `at`, cut by the axes before `upto`."""
    sizes, starts = list(shape), [0] * len(shape)
    for axis, (n, s, k) in enumerate(zip(mesh_shape(mesh), sbp, at)):
        if upto is not None and axis >= upto:
            break
        if isinstance(s, Split):  # axis 0 splits first, later axes within its shard
            start, sizes[s.dim] = chunk_range(sizes[s.dim], n, k)
            starts[s.dim] += start
    return starts, sizes


def local_shape(shape: Sequence[int], sbp: tuple, mesh: tuple, rank=None) -> Tuple[int, ...]:
    """The local component's shape on `rank` of a value with global `shape` laid out as `sbp`
    on `mesh`; rank None: the first rank's, the largest (See NOTE: Uneven splits)."""
    at = _zero_coord(mesh) if rank is None else coord(mesh, rank)
    return tuple(_shard_box(shape, sbp, mesh, at)[1])


def is_even(shape: Sequence[int], sbp: tuple, mesh: tuple) -> bool:
    """Does every rank of `mesh` hold a shard of the same shape? Exactly when every axis's
    split divides what the earlier axes left of its dim: an axis cutting a size unevenly
    leaves its last shard smaller, and later axes cannot make unequal shards equal. Read
    off the mesh's shape, not its ranks (a stage's mesh has thousands at scale)."""
    sizes = list(shape)
    for n, s in zip(mesh_shape(mesh), sbp):
        if isinstance(s, Split):
            if sizes[s.dim] % n:
                return False
            sizes[s.dim] //= n
    return True


def split_extent(shape: Sequence[int], sbp: tuple, mesh: tuple, axis: int, rank: int) -> int:
    """The size of the dim `sbp[axis]` splits, as the group of `rank` along `axis` shares it:
    cut by the earlier axes only (what that axis's shards make up together)."""
    dim = sbp[axis].dim
    return _shard_box(shape, sbp, mesh, coord(mesh, rank), upto=axis)[1][dim]


def fmt(sbp: tuple) -> str:
    return str(sbp[0]) if len(sbp) == 1 else "(" + ", ".join(map(str, sbp)) + ")"


def shard_slices(shape: Sequence[int], sbp: tuple, mesh: tuple, rank: int) -> tuple:
    """The index (a tuple of slices) of `rank`'s shard within the global tensor."""
    starts, sizes = _shard_box(shape, sbp, mesh, coord(mesh, rank))
    return tuple(slice(a, a + n) for a, n in zip(starts, sizes))


@dataclass(frozen=True)
class Pieces:
    """A split tensor stored in pieces along `dim` (See NOTE: fused pieces): `sizes` are the
    pieces' global sizes there (q, k and v of a fused projection; unequal under grouped-query
    attention), each laid out as the tensor's sbp, and a rank's local component is its shard
    of every piece, concatenated."""
    sizes: Tuple[int, ...]
    dim: int = 0

    def cut(self, full):
        """The global pieces of a full tensor."""
        return full.split(list(self.sizes), self.dim)

    def local_sizes(self, shape: Sequence[int], sbp: tuple, mesh: tuple, rank=None) -> List[int]:
        """Each piece's size along `dim` in `rank`'s local component (shape: the whole tensor's)."""
        return [local_shape(_with(shape, self.dim, n), sbp, mesh, rank)[self.dim] for n in self.sizes]

    def __str__(self) -> str:
        return f"pieces {list(self.sizes)} along dim {self.dim}"


def _with(shape: Sequence[int], dim: int, n: int) -> tuple:
    return tuple(n if d == dim else s for d, s in enumerate(shape))


def local_component(full, sbp: tuple, mesh: tuple, rank: int, pieces: "Pieces" = None):
    """`rank`'s local component of a full (broadcast) tensor laid out as `sbp` (no partial);
    for a tensor stored in pieces, this rank's shards of the pieces, concatenated (See NOTE:
    fused pieces)."""
    if pieces:
        return torch.cat([local_component(p, sbp, mesh, rank) for p in pieces.cut(full)], pieces.dim)
    return full[shard_slices(full.shape, sbp, mesh, rank)]


def place_shard(full, value, sbp: tuple, mesh: tuple, rank: int, pieces: "Pieces" = None) -> None:
    """Writes `rank`'s local component `value` into the full tensor (local_component's inverse)."""
    if pieces:
        parts = value.split(pieces.local_sizes(full.shape, sbp, mesh, rank), pieces.dim)
        for whole, part in zip(pieces.cut(full), parts):
            whole[shard_slices(whole.shape, sbp, mesh, rank)] = part
        return
    full[shard_slices(full.shape, sbp, mesh, rank)] = value
