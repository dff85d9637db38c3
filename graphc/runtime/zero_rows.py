"""ZeRO's collectives on gloo, one per rank's rows, in place: no packed bucket.

NOTE: ZeRO rows in place
gloo's reduce-scatter and all-gather copy their inputs into a flat scratch of the whole
bucket on the calling thread's side, and are slower than its all-reduce of the same bytes
(2 ranks, 24 MiB fp32, 1 thread a rank: all-reduce 25 ms, flat reduce-scatter 40-83 ms,
flat all-gather 22-35 ms), and ZeRO's packed bucket costs a copy of the whole gradient on
the compute thread, inside the backward. A rank's rows of a parameter are contiguous
(torch.chunk's rows along dim 0: sbp/layout.py chunk_range), so on a gloo group at stages
2 and 3 each bucket runs as one collective per parameter and rank, on views:
- the reduce-scatter as `reduce(grad[rows of rank k], dst=k)` for every k, in place in the
  gradient autograd made (2 ranks, 24 MiB: 32-45 ms, no pack); when they are done this
  rank's rows are copied out (half the bytes) and the whole gradient is dropped, as the
  packed path drops it;
- the all-gather (after the step; at stage 3 before a use, into the storage given back) as
  `broadcast(param[rows of rank k], src=k)` for every k, straight into the parameter, this
  rank's rows copied from its shard first where the shard owns them (10 ms for the same
  24 MiB: no pack, no scratch, no unpack).
The sums are the same two-addend sums at 2 ranks (a + b either way); at more ranks gloo
orders a reduce's additions as it orders a reduce-scatter's, by its own algorithm, which a
local world does not reproduce bit for bit at either. The choice is the plan's, the same on
every rank: a bucket whose gradients need a cast (set_grad_reduce_dtype) or whose group is not
gloo takes the packed path (zero.py: ZeroShards.scatter, zero_packed.launch_rows), and so does stage 1,
which keeps its packed buckets between steps as DDP keeps its buckets; a parameter unused in
the step adds zeros, as the packed path's zero addend.

NOTE: ZeRO rows as gradients are final
DDP launches a bucket's all-reduce once every gradient in it is ready; a bucket reduced rank
by rank has no packed buffer to wait for, so each parameter's reduces are launched as soon as
its gradient is final (GradSync's hook: the last micro-batch's accumulation), while the rest
of the backward runs, not when its bucket's last gradient is (the plan's 25 MiB buckets make
most of a small model one bucket, final at the end of the backward). Every rank launches the
same collectives in the same order, the plan's: bucket by bucket, parameter by parameter
within a bucket, a parameter only once all before it are launched
(zero_sync.py: ZeroGradSync._launch_final_rows); the REDUCE_SCATTER instruction waits for
them as before.
"""
from __future__ import annotations

from typing import List, Sequence

import torch

from .. import world
from ..sbp.layout import chunk_range


def in_place_group(ranks: Sequence[int]) -> bool:
    """Whether a ZeRO bucket over `ranks` runs as per-rank collectives on views (a gloo group
    of several ranks in the torch world)."""
    w = world.current()
    return isinstance(w, world.TorchWorld) and len(ranks) > 1 and w.is_gloo(tuple(ranks))


def rows_of(t: torch.Tensor, s, k: int) -> torch.Tensor:
    """Rank k's rows of `t` (a parameter or its gradient, of shard `s`'s parameter's shape)."""
    start, rows = chunk_range(t.shape[0], len(s.ranks), k)
    return t[start:start + rows]


class ReducedRows:
    """The reduces of one bucket's gradients, one per parameter and rank, launched parameter
    by parameter in the bucket's order (as each gradient is final: NOTE: ZeRO rows as
    gradients are final); wait() waits for them and copies this rank's summed rows into
    `out` at each shard's place (what the packed path's reduce-scatter leaves there)."""

    def __init__(self, shards: list, out: torch.Tensor):
        self.shards, self.out = shards, out
        self.works: list = []
        self.grads: List[torch.Tensor] = []

    @property
    def launched(self) -> int:
        """How many of the bucket's parameters are launched (the first ones, in its order)."""
        return len(self.grads)

    def launch_next(self, grad: torch.Tensor) -> None:
        """Starts summing the next parameter's whole gradient (contiguous, in the reduce dtype)
        rank by rank: rank k's rows reduced onto rank k, asynchronously."""
        s = self.shards[len(self.grads)]
        w = world.current()
        ranks = tuple(s.ranks)
        for k, r in enumerate(ranks):
            part = rows_of(grad, s, k)
            if part.numel():
                self.works.append(w.reduce_to(part, r, ranks, async_op=True))
        self.grads.append(grad)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        at = 0
        for s, g in zip(self.shards, self.grads):
            mine = g[s.start:s.start + s.rows].reshape(-1)
            self.out[at:at + mine.numel()].copy_(mine)
            at += s.part_numel
        self.grads = []            # the whole gradients are dropped here


def launch_broadcast_rows(shards: list) -> list:
    """Starts writing every rank's (stepped) rows of each shard's parameter into it: rank k's
    rows broadcast from rank k, asynchronously. A parameter whose rows its shard owns (stage
    3: its storage given back first; a float32 master's rows) gets this rank's rows from the
    shard first, rounded to its dtype. The works, to wait for."""
    w = world.current()
    ranks = tuple(shards[0].ranks)
    works = []
    for s in shards:
        s.materialize()
        if s.owns or s.master is not None:
            rows_of(s.param.data, s, ranks.index(w.rank)).copy_(s.shard.data)
        for k, r in enumerate(ranks):
            part = rows_of(s.param.data, s, k)
            if part.numel():
                works.append(w.broadcast_from(part, r, ranks, async_op=True))
    return works


def row_grad(p: torch.nn.Parameter) -> torch.Tensor:
    """A parameter's final gradient as its rows are reduced (contiguous; zeros for a parameter
    unused in the step, as the packed path's zero addend), taken from it: ZeRO keeps only this
    rank's rows."""
    g = p.grad
    g = torch.zeros_like(p) if g is None else g.contiguous()
    p.grad = None
    return g
