"""Collectives on sub-groups of a placement, as autograd functions, plus gradient sync.

`box(x, kind, groups, src_dim, dst_dim[, extents])` is the op insert_boxing puts into
stage programs: one SBP conversion along one mesh axis (`extents` for shards of unequal
size). `groups` lists every rank group along that axis; this rank uses the one it belongs
to. Each conversion's backward is its dual
under graphc's gradient convention (NOTE: gradient layouts, docs/sbp.md): the gradient
of a broadcast value is held whole on every rank, of a split value split the same way,
of a partial_sum value whole on every rank.

    kind            forward (SBP)        backward (of the gradient)
    all_reduce      P -> B  all-reduce   identity
    reduce_scatter  P -> S  reduce-sc.   all-gather
    all_gather      S -> B  all-gather   local slice
    all_to_all      S(i) -> S(j)         all-to-all S(j) -> S(i)
    slice           B -> S  local slice  all-gather
    to_partial      B -> P  rank 0 keeps identity
    split_partial   S -> P  zero-pad     local slice
    grad_all_reduce B -> B  identity     all-reduce (the B input of a sharded op)

Process groups are created once, by every rank in the same order (create_groups).
"""
from __future__ import annotations

from contextlib import contextmanager

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..sbp.layout import chunk_range, chunk_sizes

_GROUPS: Dict[Tuple[int, ...], object] = {}


def create_groups(rank_sets: Iterable[Sequence[int]]) -> None:
    """Creates a process group per rank set; collective over the world, deterministic order."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    for ranks in sorted({tuple(r) for r in rank_sets if len(r) > 1}):
        if ranks in _GROUPS:
            continue
        if ranks == tuple(range(world)):
            _GROUPS[ranks] = dist.group.WORLD
        else:
            _GROUPS[ranks] = dist.new_group(list(ranks))


# NOTE: Shapes only
# `graphc plan --simulate` counts a stage program's FLOPs by running it on fake tensors in
# one process, with no process group. Within `shapes_only(rank)` every collective returns a
# tensor of the shape it would return on that rank, without communicating.
_SHAPES_ONLY: list = []  # [rank] while counting shapes, else empty


@contextmanager
def shapes_only(rank: int):
    """Within the block, collectives move nothing and return their output's shape (See NOTE)."""
    _SHAPES_ONLY.append(rank)
    try:
        yield
    finally:
        _SHAPES_ONLY.pop()


def _my_group(groups: tuple) -> Tuple[object, int, int]:
    """(process group, my index in it, its size) for this rank's group among `groups`."""
    if _SHAPES_ONLY:
        rank = _SHAPES_ONLY[-1]
        g = next((g for g in groups if rank in g), groups[0])
        return None, (g.index(rank) if rank in g else 0), len(g)
    rank = dist.get_rank() if dist.is_initialized() else 0
    for g in groups:
        if rank in g:
            if len(g) > 1 and tuple(g) not in _GROUPS:
                create_groups([g])  # only reached in single-group worlds (tests, one stage)
            return _GROUPS.get(tuple(g)), g.index(rank), len(g)
    raise RuntimeError(f"internal: rank {rank} is in none of the groups {groups}")


def compiled_groups(compiled) -> List[Tuple[int, ...]]:
    """Every rank group a compiled graph's programs and plans communicate in."""
    from ..plan.instructions import AllReduce
    found = []
    for prog in compiled.programs:
        modules = [prog.module] + ([prog.prologue.module] if prog.prologue is not None else [])
        for node in (n for module in modules for n in module.graph.nodes):
            if node.op == "call_function" and node.target in (box, vocab_parallel_embedding):
                found += [tuple(g) for g in node.args[2]]
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
    dist.all_reduce(y, group=group)
    return y


def _all_gather(x, dim, group, n, extent):
    sizes = chunk_sizes(extent, n)
    if _SHAPES_ONLY:
        return x.new_empty(_with(x.shape, dim, extent))
    mine = _pad_to(x, dim, sizes[0])
    parts = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(parts, mine, group=group)
    return torch.cat([p.narrow(dim, 0, size) for p, size in zip(parts, sizes)], dim)


def _reduce_scatter(x, dim, group, n, k):
    sizes = chunk_sizes(x.shape[dim], n)
    if _SHAPES_ONLY:
        return x.new_empty(_with(x.shape, dim, sizes[k]))
    parts = [_pad_to(p, dim, sizes[0]) for p in x.split(sizes, dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out.narrow(dim, 0, sizes[k])


def _all_to_all(x, src_dim, dst_dim, group, n, k, extent):
    """Local shard of S(src_dim) -> local shard of S(dst_dim); `extent`: of src_dim."""
    src_sizes, dst_sizes = chunk_sizes(extent, n), chunk_sizes(x.shape[dst_dim], n)
    if _SHAPES_ONLY:
        return x.new_empty(_with(_with(x.shape, dst_dim, dst_sizes[k]), src_dim, extent))
    send = [_pad_to(_pad_to(p, dst_dim, dst_sizes[0]), src_dim, src_sizes[0])
            for p in x.split(dst_sizes, dst_dim)]
    recv = [torch.empty_like(p) for p in send]
    dist.all_to_all(recv, send, group=group)
    return torch.cat([p.narrow(src_dim, 0, size).narrow(dst_dim, 0, dst_sizes[k])
                      for p, size in zip(recv, src_sizes)], src_dim)


def _with(shape, dim, size) -> list:
    shape = list(shape)
    shape[dim] = size
    return shape


def all_reduce_sum(x: torch.Tensor, groups: Sequence[Sequence[int]]) -> torch.Tensor:
    """The sum of `x` over this rank's group among `groups`, as a new tensor."""
    group, _, n = _my_group(tuple(tuple(g) for g in groups))
    return _all_reduce(x, group) if n > 1 else x.clone()


def _slice(x, dim, k, n):
    start, size = chunk_range(x.shape[dim], n, k)
    return x.narrow(dim, start, size).contiguous()


def _pad(x, dim, k, n, extent):
    out = x.new_zeros(_with(x.shape, dim, extent))
    out.narrow(dim, chunk_range(extent, n, k)[0], x.shape[dim]).copy_(x)
    return out


class _Box(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kind, groups, src_dim, dst_dim, extents):
        group, k, n = _my_group(groups)
        # the sizes the group's shards make up together: of the split dim, from the box's
        # argument (one per group, uneven splits) or n equal shards; of the whole dim, local
        src_extent = -1 if src_dim < 0 else (
            extents[_group_index(groups)] if extents else x.shape[src_dim] * n)
        dst_extent = -1 if dst_dim < 0 else x.shape[dst_dim]
        ctx.meta = (kind, group, k, n, src_dim, dst_dim, src_extent, dst_extent)
        if n == 1:
            return x.clone() if kind != "grad_all_reduce" else x.view_as(x)
        if kind == "all_reduce":
            return _all_reduce(x, group)
        if kind == "reduce_scatter":
            return _reduce_scatter(x, dst_dim, group, n, k)
        if kind == "all_gather":
            return _all_gather(x, src_dim, group, n, src_extent)
        if kind == "all_to_all":
            return _all_to_all(x, src_dim, dst_dim, group, n, k, src_extent)
        if kind == "slice":
            return _slice(x, dst_dim, k, n)
        if kind == "to_partial":
            return x.clone() if k == 0 else torch.zeros_like(x)
        if kind == "split_partial":
            return _pad(x, src_dim, k, n, src_extent)
        if kind == "grad_all_reduce":
            return x.view_as(x)
        raise RuntimeError(f"internal: unknown boxing kind {kind!r}")

    @staticmethod
    def backward(ctx, g):
        kind, group, k, n, src_dim, dst_dim, src_extent, dst_extent = ctx.meta
        if n == 1 or kind in ("all_reduce", "to_partial"):
            return g, None, None, None, None, None
        if kind == "reduce_scatter":
            out = _all_gather(g, dst_dim, group, n, dst_extent)
        elif kind == "all_gather":
            out = _slice(g, src_dim, k, n)
        elif kind == "all_to_all":
            out = _all_to_all(g, dst_dim, src_dim, group, n, k, dst_extent)
        elif kind == "slice":
            out = _all_gather(g, dst_dim, group, n, dst_extent)
        elif kind == "split_partial":
            out = _slice(g, src_dim, k, n)
        else:  # grad_all_reduce
            out = _all_reduce(g, group)
        return out, None, None, None, None, None


def _group_index(groups: tuple) -> int:
    """Which of `groups` is this rank's (a box's per-group arguments line up with them)."""
    rank = _SHAPES_ONLY[-1] if _SHAPES_ONLY else (dist.get_rank() if dist.is_initialized() else 0)
    return next((i for i, g in enumerate(groups) if rank in g), 0)


def box(x: torch.Tensor, kind: str, groups: tuple, src_dim: int, dst_dim: int,
        extents: tuple = ()) -> torch.Tensor:
    """One SBP conversion along one mesh axis (see the table above). `extents`, for a value
    split unevenly on this axis: per group, the size of its split dim over the group."""
    return _Box.apply(x, kind, groups, src_dim, dst_dim, extents)


def mesh_coordinate(groups: tuple) -> Tuple[int, int]:
    """(my index, group size) along one mesh axis; used by ops whose local form needs it."""
    _, k, n = _my_group(groups)
    return k, n


# -- gradient synchronisation ----------------------------------------------------------------
class GradSync:
    """Bucketed all-reduce of partial_sum gradients, and of tied parameters' gradients among
    the stages holding them (TieAllReduce, a bucket of its own), launched as soon as they
    are final.

    A hook on every parameter counts its gradient accumulations in the step; a parameter is
    final after `expected` of them (one per micro-batch and per local stage program that
    uses it: a rank holding two chunks that share a parameter accumulates it from both). A
    bucket's all-reduce starts (async) once all its gradients are final, overlapping the
    rest of the backward, whatever the schedule's order of chunks and micro-batches.
    `wait(ins)` finishes an AllReduce instruction's bucket (launching it first if its hooks
    did not fire, e.g. unused parameters). Buckets launch in plan order on every rank.
    """

    def __init__(self, buckets: List[Tuple[Tuple[int, ...], List[torch.nn.Parameter]]],
                 expected: Optional[Dict[int, int]] = None):
        self.buckets = buckets
        self.armed = False
        self.remaining: List[int] = []
        self.works: Dict[int, Tuple[object, torch.Tensor]] = {}
        self.handles = []
        self.next = 0
        self.early = 0                      # buckets of the last step launched by hooks
        self.flats: Dict[int, torch.Tensor] = {}
        self.carried: Dict[int, torch.Tensor] = {}
        self.last_of = {id(p): i for i, (_, params) in enumerate(buckets) for p in params}
        self.index: Dict[object, int] = {}
        self.expected = expected or {}      # id(param) -> accumulations per step (default 1)
        self.count: Dict[int, int] = {}
        # a gradient partial on two mesh axes is reduced over one, then the other: a bucket
        # holding a gradient of an earlier bucket starts only once that one is back (wait)
        seen: set = set()
        self.deferred = []
        self.in_buckets: Dict[int, List[int]] = {}
        for i, (_, params) in enumerate(buckets):
            self.deferred.append(any(id(p) in seen for p in params))
            seen |= {id(p) for p in params}
            for p in params:
                self.in_buckets.setdefault(id(p), []).append(i)
        by_id = {id(p): p for _, params in buckets for p in params}
        for key, p in by_id.items():
            self.handles.append(p.register_post_accumulate_grad_hook(self._hook(key)))

    @staticmethod
    def from_plan(plan, programs) -> "GradSync | None":
        from ..plan.instructions import AllReduce, TieAllReduce
        # gradient all-reduces and ties (not ClipGradNorm); a tie names its parameters as
        # this rank's stage programs know them
        syncs = [ins for ins in plan.instructions if type(ins) in (AllReduce, TieAllReduce)]
        if not syncs or not programs:
            return None
        params: Dict[str, torch.nn.Parameter] = {}
        uses: Dict[int, int] = {}
        for prog in programs:
            for name, p in prog.module.named_parameters(remove_duplicate=False):
                params.setdefault(name, p)
            for p in {id(p): p for p in prog.module.parameters()}.values():
                uses[id(p)] = uses.get(id(p), 0) + 1
        names = [ins.params if isinstance(ins, TieAllReduce) else [t.name for t in ins.tensors]
                 for ins in syncs]
        m = plan.num_microbatches
        sync = GradSync([(ins.ranks, [params[n] for n in ns]) for ins, ns in zip(syncs, names)],
                        {k: m * n for k, n in uses.items()})
        sync.index = {ins: i for i, ins in enumerate(syncs)}
        return sync

    def _hook(self, key: int):
        def fire(_param):
            if not self.armed:
                return
            self.count[key] = self.count.get(key, 0) + 1
            if self.count[key] != self.expected.get(key, 1):
                return  # more micro-batches (or chunks) still add to this gradient
            for i in self.in_buckets[key]:
                self.remaining[i] -= 1
            # launch in bucket order on every rank: collectives on a group must match
            while (self.next < len(self.buckets) and self.remaining[self.next] == 0
                   and not self.deferred[self.next]):
                self.early += 1  # started inside the backward: overlaps the rest of it
                self._launch(self.next)
        return fire

    def start_step(self) -> None:
        """Before a step's first backward: set aside gradients left from earlier steps (no
        optimizer zeroed them), so only this step's partial sums are all-reduced; count
        this step's accumulations from zero."""
        self.carried = {}
        for _, params in self.buckets:
            for p in params:
                if p.grad is not None and id(p) not in self.carried:
                    self.carried[id(p)] = p.grad.clone()  # it may view a reused bucket
                    p.grad = None
        self.armed = True
        self.count = {}
        self.remaining = [len(params) for _, params in self.buckets]
        self.works = {}
        self.next = 0
        self.early = 0

    def _launch(self, i: int) -> None:
        ranks, params = self.buckets[i]
        group, _, n = _my_group((ranks,))
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        flat = self.flats.get(i)  # reused every step: no fresh 25 MiB allocation per bucket
        if flat is None or flat.dtype != grads[0].dtype or flat.device != grads[0].device:
            flat = self.flats[i] = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype,
                                               device=grads[0].device)
        torch.cat(grads, out=flat)
        work = dist.all_reduce(flat, group=group, async_op=True) if n > 1 else None
        self.works[i] = (work, flat)
        self.next = i + 1

    def wait(self, ins) -> None:
        """Finishes the bucket of AllReduce instruction `ins` (launching any not yet started)."""
        i = self.index[ins]
        while self.next <= i:
            self._launch(self.next)
        work, flat = self.works.pop(i)
        if work is not None:
            work.wait()
        offset = 0
        for p in self.buckets[i][1]:  # the reduced gradients are views of the bucket: no copy
            numel = p.numel()
            p.grad = flat[offset:offset + numel].view_as(p)
            if i == self.last_of.get(id(p)) and id(p) in self.carried:
                p.grad = p.grad + self.carried.pop(id(p))
            offset += numel
        if not self.works:
            self.armed = False


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
