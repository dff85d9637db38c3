"""Pieces: which rows (boxes) of a value each rank sends to each rank when the value moves
between two stages whose meshes differ in shape (an n-to-m transfer).

NOTE: Reshard pieces
Between stages of one mesh shape a value travels replica k to replica k, whole, keeping its
SBP. Between meshes of other shapes (2 ranks then 3, a 2 x 2 mesh then 2 ranks) the sender
holds the value in a layout without partial sums (insert_boxing reduces those first) and the
receiver needs it in its *arrival* layout (what its first reader needs, partial sums read as
broadcast). Every layout without partial sums gives each rank one box of the global tensor
(`shard_slices`), and the distinct boxes of one layout tile the tensor. So receiver j's box is
covered by its intersections with the sender's distinct boxes; of the replicas that hold one
box (broadcast axes) j takes replica j mod (their number), spreading the load. Each
non-empty intersection is one piece: one rank sends it, one receives it, and both know where
it sits in their local tensor. A receiver whose box is empty (an uneven split leaves it no
rows) still gets one empty piece, from sender j mod n, so every rank's program sees its
input. The gradient goes back the same way with the roles swapped: the gradient of a value
arrives in its arrival layout (insert_boxing's conversions keep a value's gradient in the
value's layout), and each sender rank collects the pieces of its own box.

Pure functions of (global shape, both layouts, both meshes): every rank computes the same
pieces, and lower_plan lists them as sends and receives (TensorSpec.at/of).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from ..placement import PartialSum, flat
from .layout import shard_slices

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]   # (starts, sizes) in the global tensor


@dataclass(frozen=True)
class Piece:
    """One box of the global tensor that rank `src` sends to rank `dst`, with where it sits
    in each one's local tensor (`src_at`, `dst_at`: offsets; `src_of`, `dst_of`: local shapes)."""

    src: int
    dst: int
    shape: Tuple[int, ...]
    src_at: Tuple[int, ...]
    src_of: Tuple[int, ...]
    dst_at: Tuple[int, ...]
    dst_of: Tuple[int, ...]


@dataclass(frozen=True)
class Reshard:
    """A value of global `shape` moving from `src_sbp` on `src_mesh` to `dst_sbp` on
    `dst_mesh` (meshes of different shapes; neither layout partial)."""

    shape: Tuple[int, ...]
    src_sbp: tuple
    src_mesh: tuple
    dst_sbp: tuple
    dst_mesh: tuple

    def forward(self) -> Tuple[Piece, ...]:
        """The value's pieces, sender ranks to receiver ranks."""
        return pieces(self.shape, self.src_sbp, self.src_mesh, self.dst_sbp, self.dst_mesh)

    def backward(self) -> Tuple[Piece, ...]:
        """The gradient's pieces, receiver ranks back to sender ranks."""
        return pieces(self.shape, self.dst_sbp, self.dst_mesh, self.src_sbp, self.src_mesh)

    def sent_by(self, rank: int, grad: bool = False) -> Tuple[Piece, ...]:
        """The pieces `rank` sends (of the gradient if grad), by receiver."""
        return _index(self.backward() if grad else self.forward())[0].get(rank, ())

    def received_by(self, rank: int, grad: bool = False) -> Tuple[Piece, ...]:
        """The pieces `rank` receives (of the gradient if grad), by sender."""
        return _index(self.backward() if grad else self.forward())[1].get(rank, ())


def box_of(shape: Sequence[int], sbp: tuple, mesh: tuple, rank: int) -> Box:
    window = shard_slices(shape, sbp, mesh, rank)
    return tuple(s.start for s in window), tuple(s.stop - s.start for s in window)


@functools.lru_cache(maxsize=4096)
def pieces(shape: Tuple[int, ...], src_sbp: tuple, src_mesh: tuple, dst_sbp: tuple,
           dst_mesh: tuple) -> Tuple[Piece, ...]:
    """Every piece of an n-to-m transfer, by receiver in mesh order (See NOTE: Reshard pieces)."""
    for sbp in (src_sbp, dst_sbp):
        if any(isinstance(s, PartialSum) for s in sbp):
            raise ValueError(f"pieces of a partial_sum layout {sbp}: reduce it first")
    senders = flat(src_mesh)
    held: Dict[Box, List[int]] = {}     # each distinct sender box -> the ranks holding it
    for r in senders:
        held.setdefault(box_of(shape, src_sbp, src_mesh, r), []).append(r)
    out: List[Piece] = []
    for j, dst in enumerate(flat(dst_mesh)):
        want = box_of(shape, dst_sbp, dst_mesh, dst)
        mine: List[Piece] = []
        for have, ranks in held.items():
            common = _intersect(have, want)
            if common is not None:
                mine.append(_piece(ranks[j % len(ranks)], dst, common, have, want))
        if not mine:    # an empty box: one empty piece, so the receiver still gets its input
            src = senders[j % len(senders)]
            have = box_of(shape, src_sbp, src_mesh, src)
            mine.append(_piece(src, dst, want, have, want))   # want holds no element
        out += mine
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _index(all_pieces: Tuple[Piece, ...]):
    by_src: Dict[int, List[Piece]] = {}
    by_dst: Dict[int, List[Piece]] = {}
    for p in all_pieces:
        by_src.setdefault(p.src, []).append(p)
        by_dst.setdefault(p.dst, []).append(p)
    key = lambda peer: lambda p: getattr(p, peer)  # noqa: E731
    return ({r: tuple(sorted(v, key=key("dst"))) for r, v in by_src.items()},
            {r: tuple(sorted(v, key=key("src"))) for r, v in by_dst.items()})


def _intersect(a: Box, b: Box):
    """The common box of a and b, or None where it holds no element."""
    starts, sizes = [], []
    for a0, an, b0, bn in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
        if hi <= lo:
            return None
        starts.append(lo)
        sizes.append(hi - lo)
    return tuple(starts), tuple(sizes)


def _piece(src: int, dst: int, common: Box, have: Box, want: Box) -> Piece:
    at = lambda box: tuple(max(0, c - s) for c, s in zip(common[0], box[0]))  # noqa: E731
    return Piece(src, dst, common[1], at(have), have[1], at(want), want[1])
