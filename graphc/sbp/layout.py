"""Meshes and layouts: which ranks hold a value and how its global shape maps to local shards.

A mesh is the `ranks` of a placement: a flat tuple (1-D) or a tuple of equal rows (2-D).
An nd-SBP is a tuple with one SBP value per mesh axis. Axis 0 of a 2-D mesh indexes rows,
axis 1 columns; when two axes split the same tensor dim, axis 0 splits first (outer).
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from ..placement import Broadcast, PartialSum, Split

B = Broadcast()
P = PartialSum()
S = Split


def mesh_shape(mesh: tuple) -> Tuple[int, ...]:
    if mesh and isinstance(mesh[0], tuple):
        return (len(mesh), len(mesh[0]))
    return (len(mesh),)


def same_shape(a: tuple, b: tuple) -> bool:
    """Do two meshes have the same shape? Only then does a layout carry over axis by axis
    between their stages (replica k to replica k); otherwise a value crosses whole."""
    return mesh_shape(a) == mesh_shape(b)


def flat(mesh: tuple) -> Tuple[int, ...]:
    if mesh and isinstance(mesh[0], tuple):
        return tuple(r for row in mesh for r in row)
    return tuple(mesh)


def axis_groups(mesh: tuple, axis: int) -> Tuple[Tuple[int, ...], ...]:
    """The rank groups that talk along mesh `axis` (one group per position on the other axes)."""
    if not (mesh and isinstance(mesh[0], tuple)):
        return (tuple(mesh),)
    rows = [tuple(row) for row in mesh]
    if axis == 1:
        return tuple(rows)
    return tuple(tuple(row[c] for row in rows) for c in range(len(rows[0])))


def coord(mesh: tuple, rank: int) -> Tuple[int, ...]:
    """This rank's index along every mesh axis."""
    if mesh and isinstance(mesh[0], tuple):
        for i, row in enumerate(mesh):
            if rank in row:
                return (i, row.index(rank))
    return (tuple(mesh).index(rank),)


def local_shape(shape: Sequence[int], sbp: tuple, mesh: tuple) -> Tuple[int, ...]:
    """The local component's shape of a value with global `shape` laid out as `sbp` on `mesh`."""
    out = list(shape)
    for n, s in zip(mesh_shape(mesh), sbp):
        if isinstance(s, Split):
            out[s.dim] //= n
    return tuple(out)


def fmt(sbp: tuple) -> str:
    return str(sbp[0]) if len(sbp) == 1 else "(" + ", ".join(map(str, sbp)) + ")"


def shard_slices(shape: Sequence[int], sbp: tuple, mesh: tuple, rank: int) -> tuple:
    """The index (a tuple of slices) of `rank`'s shard within the global tensor."""
    index = [slice(None)] * len(shape)
    sizes = list(shape)
    starts = [0] * len(shape)
    for n, s, k in zip(mesh_shape(mesh), sbp, coord(mesh, rank)):
        if isinstance(s, Split):  # axis 0 splits first, later axes within its shard
            sizes[s.dim] //= n
            starts[s.dim] += k * sizes[s.dim]
    for d in range(len(shape)):
        index[d] = slice(starts[d], starts[d] + sizes[d])
    return tuple(index)


def local_component(full, sbp: tuple, mesh: tuple, rank: int, pieces=None):
    """`rank`'s local component of a full (broadcast) tensor laid out as `sbp` (no partial).

    pieces=(k, dim): a tensor stored in k pieces along dim, each laid out as `sbp`; the local
    component is this rank's shards of the pieces, concatenated (See NOTE: fused pieces)."""
    if pieces:
        k, dim = pieces
        return torch.cat([local_component(p, sbp, mesh, rank) for p in full.chunk(k, dim)], dim)
    return full[shard_slices(full.shape, sbp, mesh, rank)]


def place_shard(full, value, sbp: tuple, mesh: tuple, rank: int, pieces=None) -> None:
    """Writes `rank`'s local component `value` into the full tensor (local_component's inverse)."""
    if pieces:
        k, dim = pieces
        for whole, part in zip(full.chunk(k, dim), value.chunk(k, dim)):
            whole[shard_slices(whole.shape, sbp, mesh, rank)] = part
        return
    full[shard_slices(full.shape, sbp, mesh, rank)] = value
