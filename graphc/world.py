"""The world a rank communicates in: every collective, transfer and rank query of graphc
goes through this module.

NOTE: Worlds
Two kinds of world carry the same calls:
- the job's torch.distributed default group (torchrun: one process per rank, gloo, NCCL,
  shared memory for point to point, see comm.py): `TorchWorld`;
- a local world (graphc/runtime/local_world.py): every rank of a job is a thread of this one
  process, and transfers and collectives move tensors between the threads in memory.
  `graphc check` and `graphc.testing.local_world` run the unchanged runtime (the same plans,
  stage programs and instruction loop) in it, so a local run is evidence about real runs.

`current()` is the world of the calling thread: a local world's rank when the thread runs
one, else the torch.distributed group when one is initialised, else None (one process
alone: every collective is over a group of one and moves nothing).

Groups are named by their ranks (a sorted tuple); a torch world creates its process groups
once, every rank in the same order (`create_groups`), and keeps them by those ranks.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

Ranks = Tuple[int, ...]

_THREAD = threading.local()   # .world: the local world's rank this thread runs, if any


# the flat collectives under their current names (torch 2.13 deprecates the *_tensor ones with
# a FutureWarning per process); the GPU machines' torch 2.11 may have only the old names
_ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_FLAT = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# gloo's all_to_all of tensor lists came in torch 2.13 (2.11's raises "Backend gloo does not
# support alltoall"); before it, TorchWorld.all_to_all sends the parts flat (all_to_all_single)
_GLOO_LIST_ALL_TO_ALL = torch.__version__ >= "2.13"


class TorchWorld:
    """torch.distributed's default group and the groups created for graphc's rank sets."""

    kind = "torch"

    def __init__(self):
        self.groups: Dict[Ranks, object] = {}

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def size(self) -> int:
        return dist.get_world_size()

    # -- groups ----------------------------------------------------------------------
    def create_groups(self, rank_sets: Iterable[Sequence[int]]) -> None:
        """A process group per rank set; collective over the world, in a sorted order."""
        world = self.size
        for ranks in sorted({tuple(r) for r in rank_sets if len(r) > 1}):
            if ranks in self.groups:
                continue
            self.groups[ranks] = (dist.group.WORLD if ranks == tuple(range(world))
                                  else dist.new_group(list(ranks)))

    def group(self, ranks: Optional[Ranks]):
        if ranks is None:
            return None
        ranks = tuple(ranks)
        if ranks not in self.groups:
            self.create_groups([ranks])   # only reached in single-group worlds (tests, one stage)
        return self.groups.get(ranks)

    # -- collectives (ranks None: the whole world) -----------------------------------
    def all_reduce(self, t: torch.Tensor, ranks: Optional[Ranks] = None, op: str = "sum",
                   async_op: bool = False):
        return dist.all_reduce(t, op=_REDUCE_OPS[op](), group=self.group(ranks), async_op=async_op)

    def all_gather(self, parts: List[torch.Tensor], t: torch.Tensor, ranks: Optional[Ranks] = None):
        dist.all_gather(parts, t, group=self.group(ranks))

    def reduce_scatter(self, out: torch.Tensor, parts: List[torch.Tensor], ranks: Optional[Ranks] = None,
                       async_op: bool = False):
        return dist.reduce_scatter(out, parts, group=self.group(ranks), async_op=async_op)

    def broadcast_from(self, t: torch.Tensor, src: int, ranks: Ranks, async_op: bool = False):
        """`t` of rank `src` (one of `ranks`) into every rank's `t`; on gloo it needs no
        scratch of its size, where a gather needs one of the whole output's (ZeRO units)."""
        return dist.broadcast(t, src=src, group=self.group(ranks), async_op=async_op)

    def reduce_to(self, t: torch.Tensor, dst: int, ranks: Ranks, async_op: bool = False):
        """The sum over `ranks` of their `t` into rank `dst`'s `t` (the others' `t` is scratch)."""
        return dist.reduce(t, dst=dst, group=self.group(ranks), async_op=async_op)

    def is_gloo(self, ranks: Ranks) -> bool:
        return dist.get_backend(self.group(ranks)) == "gloo"

    # the flat forms (one tensor of all ranks' parts): NCCL's native ones, and on gloo 1.2-1.7x
    # faster than the list forms above (16 MiB on 2 ranks); ZeRO's buckets use them
    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor, ranks: Optional[Ranks] = None,
                        async_op: bool = False):
        return _ALL_GATHER_FLAT(out, t, group=self.group(ranks), async_op=async_op)

    def reduce_scatter_from(self, out: torch.Tensor, t: torch.Tensor, ranks: Optional[Ranks] = None,
                            async_op: bool = False):
        return _REDUCE_SCATTER_FLAT(out, t, group=self.group(ranks), async_op=async_op)

    def all_to_all(self, recv: List[torch.Tensor], send: List[torch.Tensor], ranks: Optional[Ranks] = None):
        group = self.group(ranks)
        if dist.get_backend(group) != "gloo" or (_GLOO_LIST_ALL_TO_ALL and _same_shapes(recv + send)):
            dist.all_to_all(recv, send, group=group)
        else:
            _all_to_all_flat(recv, send, group)

    def broadcast(self, t: torch.Tensor, src: int):
        dist.broadcast(t, src)

    def send(self, t: torch.Tensor, dst: int):
        dist.send(t, dst)

    def recv(self, t: torch.Tensor, src: int):
        dist.recv(t, src)

    def isend(self, t: torch.Tensor, peer: int, tag: int, ranks: Optional[Ranks] = None):
        return dist.isend(t, peer, group=self.group(ranks) if ranks else None, tag=tag)

    def irecv(self, t: torch.Tensor, peer: int, tag: int, ranks: Optional[Ranks] = None):
        return dist.irecv(t, peer, group=self.group(ranks) if ranks else None, tag=tag)

    def all_gather_object(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def gather_object(self, obj: Any, dst: int = 0) -> Optional[List[Any]]:
        out = [None] * self.size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        dist.barrier()

    def store(self):
        return dist.distributed_c10d._get_default_store()


def _same_shapes(parts: List[torch.Tensor]) -> bool:
    """gloo's list all_to_all takes parts of one shape only; an expert layer's exchanges
    (See NOTE: Expert parallel) send as many rows as the routing gives, empty ones included."""
    return all(p.shape == parts[0].shape for p in parts)


def _all_to_all_flat(recv: List[torch.Tensor], send: List[torch.Tensor], group) -> None:
    """dist.all_to_all as one all_to_all_single over the parts laid end to end (on gloo before
    torch 2.13, or parts of different sizes): part i of `send` goes to rank i, rank i's part
    lands in recv[i]."""
    flat = torch.empty(sum(r.numel() for r in recv), dtype=recv[0].dtype, device=recv[0].device)
    dist.all_to_all_single(flat, torch.cat([s.reshape(-1) for s in send]),
                           output_split_sizes=[r.numel() for r in recv],
                           input_split_sizes=[s.numel() for s in send], group=group)
    for r, part in zip(recv, flat.split([r.numel() for r in recv])):
        r.copy_(part.view(r.shape))


_REDUCE_OPS = {"sum": lambda: dist.ReduceOp.SUM, "max": lambda: dist.ReduceOp.MAX}
_TORCH = TorchWorld()


def current():
    """The calling thread's world (See NOTE: Worlds), or None in a process alone."""
    local = getattr(_THREAD, "world", None)
    if local is not None:
        return local
    if dist.is_available() and dist.is_initialized():
        return _TORCH
    return None


def torch_world() -> Optional[TorchWorld]:
    """The torch.distributed world when the calling thread is in it (not in a local world)."""
    world = current()
    return world if isinstance(world, TorchWorld) else None


def rank() -> int:
    world = current()
    return world.rank if world is not None else 0


def size() -> int:
    world = current()
    return world.size if world is not None else 1


def rank_and_size() -> Tuple[int, int]:
    return rank(), size()


def multi() -> Optional[Any]:
    """The world when it has more than one rank, else None (nothing to communicate)."""
    world = current()
    return world if world is not None and world.size > 1 else None


@contextmanager
def entered(world):
    """Within the block, the calling thread is `world`'s rank (a local world's)."""
    before = getattr(_THREAD, "world", None)
    _THREAD.world = world
    try:
        yield world
    finally:
        _THREAD.world = before


def reset_torch_groups() -> None:
    """Forget the torch world's groups (a new default group after destroy_process_group)."""
    _TORCH.groups.clear()


# Random ops seed torch's one default generator (random_ops.seeded); the ranks of a local
# world are threads of one process, so each such draw holds this lock.
RNG_LOCK = threading.RLock()
