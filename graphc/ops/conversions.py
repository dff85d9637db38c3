"""The functions a stage program may call: SBP conversions, vocabulary-parallel lookups.

Passes put calls to these into the fx programs (insert_boxing: `box`; localize_ops:
`vocab_parallel_embedding`), and the runtime runs those programs (See NOTE: Stage-program
names in graphc/ops/__init__.py: `graphc.ops.conversions.box`).

`box(x, kind, groups, src_dim, dst_dim[, extents])` is one SBP conversion along one mesh
axis (`extents` for shards of unequal size). `groups` lists every rank group along that
axis; this rank uses the one it belongs to. Each conversion's backward is its dual under
graphc's gradient convention (NOTE: gradient layouts, docs/sbp.md). The kinds, the
collective each launches and its dual are the boxing table, graphc/sbp/boxing.py.

Process groups are created once, by every rank in the same order (create_groups), and
kept by the world (graphc/world.py).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, List, Sequence, Tuple

import torch

from .. import world
from ..plan.instructions import AllReduce
from ..sbp.boxing import BOXINGS
from ..sbp.layout import chunk_range, chunk_sizes, zigzag_order

# NOTE: Rank groups in code
# fx prints a call's arguments into the program's Python one value at a time, and a box
# names every group of its mesh axis: thousands of ints at thousands of ranks, printed again
# at every recompile and history record (most of a rank's compile at 8192 ranks). A tuple
# with `_fields` is printed as its class called with the tuple's builtin repr, written at C
# speed; the program then reads `RankGroups((0, 1), (2, 3))`, equal to the plain tuple.
class RankGroups(tuple):
    """Every rank group along one mesh axis, as a stage program's `box` call takes them: a
    tuple of rank tuples (See NOTE: Rank groups in code)."""

    _fields = ()   # what fx reads to print a value as `Class(*items)` (its NamedTuple path)

    def __new__(cls, *groups):
        return super().__new__(cls, tuple(tuple(g) for g in groups))

    def __reduce__(self):
        return (RankGroups, tuple(self))


def create_groups(rank_sets: Iterable[Sequence[int]]) -> None:
    """Creates a process group per rank set; collective over the world, deterministic order
    (a local world needs none: See NOTE: Worlds in graphc/world.py)."""
    torch_world = world.torch_world()
    if torch_world is not None:
        torch_world.create_groups(rank_sets)


# NOTE: Shapes only
# `graphc plan --simulate` runs stage programs in one process, with no process group: on fake
# tensors to count FLOPs (h100, ...), on real ones to time their compute (measure, in
# graphc/tools/costs.py). Within `shapes_only(rank)` every collective returns a tensor of the
# shape it would return on that rank (zeros: no garbage NaN or denormal slows a timed kernel),
# without communicating; the plan's Collective instructions carry the communication, which
# the simulator models.
_SHAPES_ONLY: list = []  # [rank] while counting shapes, else empty


@contextmanager
def shapes_only(rank: int):
    """Within the block, collectives move nothing and return their output's shape (See NOTE)."""
    _SHAPES_ONLY.append(rank)
    try:
        yield
    finally:
        _SHAPES_ONLY.pop()


def counting_shapes() -> bool:
    """Within shapes_only: a collective returns its output's shape and moves nothing."""
    return bool(_SHAPES_ONLY)


def my_group(groups: tuple) -> Tuple[Tuple[int, ...], int, int]:
    """(its ranks, my index in it, its size) for this rank's group among `groups`."""
    if _SHAPES_ONLY:
        rank = _SHAPES_ONLY[-1]
        g = next((g for g in groups if rank in g), groups[0])
        return tuple(g), (g.index(rank) if rank in g else 0), len(g)
    rank = world.rank()
    for g in groups:
        if rank in g:
            return tuple(g), g.index(rank), len(g)
    raise RuntimeError(f"internal: rank {rank} is in none of the groups {groups}")


def from_every_rank(groups: List[Tuple[int, ...]], whole_world: bool) -> List[Tuple[int, ...]]:
    """Every rank's groups, when each rank compiled only its own plan (NOTE: Plans of some
    ranks): a torch world creates every group on every rank, in one order, so the ranks
    exchange theirs. A local world needs no groups."""
    torch_world = world.torch_world()
    if whole_world or torch_world is None:
        return groups
    return sorted({tuple(g) for mine in torch_world.all_gather_object(sorted(set(groups))) for g in mine})


def compiled_groups(compiled) -> List[Tuple[int, ...]]:
    """Every rank group a compiled graph's programs and the plans it holds communicate in."""
    found = []
    for prog in compiled.programs:
        modules = [prog.module] + ([prog.prologue.module] if prog.prologue is not None else [])
        for node in (n for module in modules for n in module.graph.nodes):
            if node.op == "call_function" and node.target in (box, vocab_parallel_embedding):
                found += [tuple(g) for g in node.args[2]]
            elif node.op == "call_function" and isinstance(node.kwargs.get("groups"), RankGroups):
                found += [tuple(g) for g in node.kwargs["groups"]]   # expert_parallel's
        if prog.prologue is not None:
            found += [tuple(g) for groups in prog.prologue.groups for g in groups]
    for plan in compiled.plans:
        found += [tuple(ins.ranks) for ins in plan.instructions if isinstance(ins, AllReduce)]
    return found


# -- primitives on the local component ----------------------------------------------------
# Shards may differ in size (See NOTE: Uneven splits, docs/sbp.md): each collective pads
# them to the largest, moves equal pieces, and cuts the padding off again. `extent` is the
# size of the split dim that the group's shards make up together.
def _pad_to(x, dim, size):
    if x.shape[dim] == size:
        return x.contiguous()
    return torch.cat([x, x.new_zeros(_with(x.shape, dim, size - x.shape[dim]))], dim)


def _all_reduce(x, group):
    if _SHAPES_ONLY:
        return x.contiguous().clone()
    y = x.contiguous().clone()
    world.current().all_reduce(y, group)
    return y


def _all_gather(x, dim, group, n, extent):
    sizes = chunk_sizes(extent, n)
    if _SHAPES_ONLY:
        return x.new_zeros(_with(x.shape, dim, extent))
    mine = _pad_to(x, dim, sizes[0])
    parts = [torch.empty_like(mine) for _ in range(n)]
    world.current().all_gather(parts, mine, group)
    return torch.cat([p.narrow(dim, 0, size) for p, size in zip(parts, sizes)], dim)


def _reduce_scatter(x, dim, group, n, k):
    sizes = chunk_sizes(x.shape[dim], n)
    if _SHAPES_ONLY:
        return x.new_zeros(_with(x.shape, dim, sizes[k]))
    parts = [_pad_to(p, dim, sizes[0]) for p in x.split(sizes, dim)]
    out = torch.empty_like(parts[0])
    world.current().reduce_scatter(out, parts, group)
    return out.narrow(dim, 0, sizes[k])


def _all_to_all(x, src_dim, dst_dim, group, n, k, extent):
    """Local shard of S(src_dim) -> local shard of S(dst_dim); `extent`: of src_dim."""
    src_sizes, dst_sizes = chunk_sizes(extent, n), chunk_sizes(x.shape[dst_dim], n)
    if _SHAPES_ONLY:
        return x.new_zeros(_with(_with(x.shape, dst_dim, dst_sizes[k]), src_dim, extent))
    send = [_pad_to(_pad_to(p, dst_dim, dst_sizes[0]), src_dim, src_sizes[0])
            for p in x.split(dst_sizes, dst_dim)]
    recv = [torch.empty_like(p) for p in send]
    world.current().all_to_all(recv, send, group)
    return torch.cat([p.narrow(src_dim, 0, size).narrow(dst_dim, 0, dst_sizes[k])
                      for p, size in zip(recv, src_sizes)], src_dim)


def _with(shape, dim, size) -> list:
    shape = list(shape)
    shape[dim] = size
    return shape


def all_reduce_sum(x: torch.Tensor, groups: Sequence[Sequence[int]]) -> torch.Tensor:
    """The sum of `x` over this rank's group among `groups`, as a new tensor."""
    group, _, n = my_group(tuple(tuple(g) for g in groups))
    return _all_reduce(x, group) if n > 1 else x.clone()


def _slice(x, dim, k, n):
    start, size = chunk_range(x.shape[dim], n, k)
    return x.narrow(dim, start, size).contiguous()


def _pad(x, dim, k, n, extent):
    out = x.new_zeros(_with(x.shape, dim, extent))
    out.narrow(dim, chunk_range(extent, n, k)[0], x.shape[dim]).copy_(x)
    return out


# One runner per kind of the boxing table (sbp/boxing.py), called as
# run(x, src_dim, dst_dim, extent, group, k, n): `extent` is the size of the split src dim
# over the group, k this rank's index in it. A backward runs its kind's dual with the dims
# swapped.
_RUN = {
    "all_reduce": lambda x, s, d, e, group, k, n: _all_reduce(x, group),
    "reduce_scatter": lambda x, s, d, e, group, k, n: _reduce_scatter(x, d, group, n, k),
    "all_gather": lambda x, s, d, e, group, k, n: _all_gather(x, s, group, n, e),
    "all_to_all": lambda x, s, d, e, group, k, n: _all_to_all(x, s, d, group, n, k, e),
    "slice": lambda x, s, d, e, group, k, n: _slice(x, d, k, n),
    "slice_summed_grad": lambda x, s, d, e, group, k, n: _slice(x, d, k, n),
    "to_partial": lambda x, s, d, e, group, k, n: x.clone() if k == 0 else torch.zeros_like(x),
    "split_partial": lambda x, s, d, e, group, k, n: _pad(x, s, k, n, e),
    "grad_all_reduce": lambda x, s, d, e, group, k, n: x.view_as(x),
    "gather_scatter": lambda x, s, d, e, group, k, n: _all_gather(x, s, group, n, e),
    "redeal": lambda x, s, d, e, group, k, n: _slice(_all_gather(x, s, group, n, e), d, k, n),
}


class _Box(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kind, groups, src_dim, dst_dim, extents, zigzag):
        group, k, n = my_group(groups)
        # the sizes the group's shards make up together: of the split dim, from the box's
        # argument (one per group, uneven splits) or n equal shards; of the whole dim, local
        src_extent = -1 if src_dim < 0 else (
            extents[_group_index(groups)] if extents else x.shape[src_dim] * n)
        dst_extent = -1 if dst_dim < 0 else x.shape[dst_dim]
        ctx.meta = (kind, group, k, n, src_dim, dst_dim, dst_extent, zigzag)
        if n == 1:
            return x.clone() if kind != "grad_all_reduce" else x.view_as(x)
        if kind not in _RUN:
            raise RuntimeError(f"internal: unknown boxing kind {kind!r}")
        return _dealt(kind, x, src_dim, dst_dim, src_extent, group, k, n, zigzag)

    @staticmethod
    def backward(ctx, g):
        kind, group, k, n, src_dim, dst_dim, dst_extent, zigzag = ctx.meta
        dual = BOXINGS[kind].dual
        if n == 1 or dual is None:
            return g, None, None, None, None, None, None
        return (_dealt(dual, g, dst_dim, src_dim, dst_extent, group, k, n, zigzag[::-1]),
                None, None, None, None, None, None)


def _dealt(kind, x, src_dim, dst_dim, extent, group, k, n, zigzag):
    """Runs one conversion whose split dims may be dealt zig-zag (`zigzag`: (src, dst); See
    NOTE: Zig-zag dealing): the dim it splits is put in the ranks' zig-zag order while still
    whole, then cut as usual; the dim it gathers, whole after, is put back in global order."""
    src_zig, dst_zig = zigzag
    if kind == "redeal":
        whole = _reordered(_all_gather(x, src_dim, group, n, extent), src_dim, n, src_zig, back=True)
        return _slice(_reordered(whole, dst_dim, n, dst_zig), dst_dim, k, n)
    if dst_zig and dst_dim >= 0:
        x = _reordered(x, dst_dim, n, True)
    out = _RUN[kind](x, src_dim, dst_dim, extent, group, k, n)
    return _reordered(out, src_dim, n, True, back=True) if src_zig and src_dim >= 0 else out


def _reordered(x, dim, n, zigzag: bool, back: bool = False):
    """A whole dim in the ranks' zig-zag order (back: from it to global order)."""
    if not zigzag:
        return x
    order = torch.tensor(zigzag_order(x.shape[dim], n), device=x.device)
    if back:
        order = torch.argsort(order)
    return x.index_select(dim, order)


def _group_index(groups: tuple) -> int:
    """Which of `groups` is this rank's (a box's per-group arguments line up with them)."""
    rank = _SHAPES_ONLY[-1] if _SHAPES_ONLY else world.rank()
    return next((i for i, g in enumerate(groups) if rank in g), 0)


def box(x: torch.Tensor, kind: str, groups: tuple, src_dim: int, dst_dim: int,
        extents: tuple = (), zigzag: tuple = (False, False)) -> torch.Tensor:
    """One SBP conversion along one mesh axis (see the table above). `extents`, for a value
    split unevenly on this axis: per group, the size of its split dim over the group;
    `zigzag`: whether its source and destination splits are dealt zig-zag (See NOTE: Zig-zag
    dealing, graphc/sbp/layout.py)."""
    return _Box.apply(x, kind, groups, src_dim, dst_dim, extents, tuple(zigzag))


def mesh_coordinate(groups: tuple) -> Tuple[int, int]:
    """(my index, group size) along one mesh axis; used by ops whose local form needs it."""
    _, k, n = my_group(groups)
    return k, n


def vocab_parallel_embedding(idx: torch.Tensor, weight: torch.Tensor, groups: tuple,
                             rows: int = 0) -> torch.Tensor:
    """Embedding with the table split by rows (vocabulary): rows outside this rank's range
    give zeros, so the ranks' outputs are addends (partial_sum) of the full lookup. `rows`
    is the whole table's, which places this rank's shard (See NOTE: Uneven splits)."""
    k, n = mesh_coordinate(groups)
    if weight.shape[0] == 0:  # an empty shard (fewer rows than ranks): every row elsewhere
        return weight.new_zeros(tuple(idx.shape) + tuple(weight.shape[1:])) + weight.sum()
    start = chunk_range(rows, n, k)[0] if rows else k * weight.shape[0]
    local = idx - start
    inside = (local >= 0) & (local < weight.shape[0])
    out = torch.nn.functional.embedding(local.clamp(0, weight.shape[0] - 1), weight)
    return out * inside.unsqueeze(-1).to(out.dtype)
