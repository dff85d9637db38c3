"""One rank of a local world as graphc.world sees it (NOTE: Local world, local_world.py):
the collectives, transfers and store calls of graphc.world's TorchWorld, made in memory
through the LocalWorld whose thread runs the rank.

Collectives combine the ranks' tensors in the group's rank order (a sum is
((x0 + x1) + x2) + ...), so a run is deterministic; with two ranks per group it is
bitwise what gloo computes.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch

if TYPE_CHECKING:
    from .local_world import LocalWorld

Ranks = Tuple[int, ...]


class _Done:
    """A transfer that completed when it was posted (a send: the data is copied)."""

    def wait(self, *args) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Pending:
    """A receive or an asynchronous collective: `wait` blocks until it can complete."""

    def __init__(self, finish: Callable[[], None], ready: Callable[[], bool]):
        self.finish, self.ready, self.completed = finish, ready, False

    def wait(self, *args) -> bool:
        if not self.completed:
            self.finish()
            self.completed = True
        return True

    def is_completed(self) -> bool:
        return self.completed


def _in_order(data: Dict[int, Any], ranks: Ranks) -> list:
    return [data[r] for r in ranks]


def sum_in_order(values: list) -> torch.Tensor:
    """((v0 + v1) + v2) + ...: a group's sum in its rank order."""
    acc = values[0].clone()
    for v in values[1:]:
        acc = acc + v
    return acc


def _max(values: list) -> torch.Tensor:
    acc = values[0].clone()
    for v in values[1:]:
        acc = torch.maximum(acc, v)
    return acc


_REDUCE = {"sum": sum_in_order, "max": _max}


class LocalRank:
    """One rank of a LocalWorld: the calls of graphc.world's TorchWorld, in memory."""

    kind = "local"

    def __init__(self, owner: LocalWorld, rank: int):
        self.world, self.rank, self.size = owner, rank, owner.size

    def _group(self, ranks) -> Ranks:
        return tuple(ranks) if ranks else tuple(range(self.size))

    # -- collectives --------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, ranks=None, op: str = "sum", async_op: bool = False):
        ranks = self._group(ranks)
        slot = self.world.join(self.rank, f"all_reduce({op})", ranks, t.detach().clone(),
                               lambda d: _REDUCE[op](_in_order(d, ranks)))
        work = _Pending(lambda: t.copy_(self.world.collect(self.rank, slot)), lambda: slot.done)
        if async_op:
            return work
        work.wait()
        return None

    def all_gather(self, parts: List[torch.Tensor], t: torch.Tensor, ranks=None) -> None:
        ranks = self._group(ranks)
        slot = self.world.join(self.rank, "all_gather", ranks, t.detach().clone(), lambda d: _in_order(d, ranks))
        for p, v in zip(parts, self.world.collect(self.rank, slot)):
            p.copy_(v)

    def reduce_scatter(self, out: torch.Tensor, parts: List[torch.Tensor], ranks=None) -> None:
        ranks = self._group(ranks)
        slot = self.world.join(self.rank, "reduce_scatter", ranks, [p.detach().clone() for p in parts],
                               lambda d: [sum_in_order([d[r][i] for r in ranks]) for i in range(len(ranks))])
        out.copy_(self.world.collect(self.rank, slot)[ranks.index(self.rank)])

    def all_to_all(self, recv: List[torch.Tensor], send: List[torch.Tensor], ranks=None) -> None:
        ranks = self._group(ranks)
        slot = self.world.join(self.rank, "all_to_all", ranks, [s.detach().clone() for s in send],
                               lambda d: dict(d))
        got = self.world.collect(self.rank, slot)
        me = ranks.index(self.rank)
        for j, r in enumerate(ranks):
            recv[j].copy_(got[r][me])

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        ranks = self._group(None)
        slot = self.world.join(self.rank, f"broadcast(from {src})", ranks,
                               t.detach().clone() if self.rank == src else None, lambda d: d[src])
        value = self.world.collect(self.rank, slot)
        if self.rank != src:
            t.copy_(value)

    def barrier(self) -> None:
        ranks = self._group(None)
        self.world.collect(self.rank, self.world.join(self.rank, "barrier", ranks, None, lambda d: None))

    def all_gather_object(self, obj: Any) -> List[Any]:
        ranks = self._group(None)
        slot = self.world.join(self.rank, "all_gather_object", ranks, obj, lambda d: _in_order(d, ranks))
        return list(self.world.collect(self.rank, slot))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        ranks = self._group(None)
        slot = self.world.join(self.rank, f"broadcast_object(from {src})", ranks, obj, lambda d: d[src])
        return self.world.collect(self.rank, slot)

    def gather_object(self, obj: Any, dst: int = 0) -> Optional[List[Any]]:
        got = self.all_gather_object(obj)
        return got if self.rank == dst else None

    # -- point to point -----------------------------------------------------------------
    def isend(self, t: torch.Tensor, peer: int, tag: int = 0, ranks=None):
        with self.world.cond:
            self.world.mail[(self.rank, peer, tag)].append(t.detach().clone())
            self.world.cond.notify_all()
        return _Done()

    def irecv(self, t: torch.Tensor, peer: int, tag: int = 0, ranks=None):
        box = self.world.mail[(peer, self.rank, tag)]

        def finish() -> None:
            self.world.block(self.rank, lambda: f"a transfer from rank {peer} (tag {tag})", lambda: bool(box))
            with self.world.cond:
                value = box.popleft()
            t.copy_(value)
        return _Pending(finish, lambda: bool(box))

    def send(self, t: torch.Tensor, dst: int) -> None:
        self.isend(t, dst, 0)

    def recv(self, t: torch.Tensor, src: int) -> None:
        self.irecv(t, src, 0).wait()

    # -- the store (rank agreement, the base seed) ---------------------------------------
    def store(self) -> "LocalStore":
        return LocalStore(self)

    @property
    def process_key(self) -> tuple:
        """Names this rank's 'process': state kept per process (graph counters) is per rank."""
        return (self.world.serial, self.rank)


class LocalStore:
    """The c10d store's calls graphc makes, over the local world's dict."""

    def __init__(self, rank: LocalRank):
        self.rank, self.world = rank.rank, rank.world

    def set(self, key: str, value) -> None:
        with self.world.cond:
            self.world.kv[key] = value.encode() if isinstance(value, str) else bytes(value)
            self.world.cond.notify_all()

    def _wait(self, keys: List[str]) -> None:
        kv = self.world.kv
        self.world.block(self.rank, lambda: f"store keys {[k for k in keys if k not in kv]}",
                         lambda: all(k in kv for k in keys))

    def get(self, key: str) -> bytes:
        self._wait([key])
        return self.world.kv[key]

    def wait(self, keys: List[str], timeout=None) -> None:
        self._wait(list(keys))

    def check(self, keys: List[str]) -> bool:
        """True once every key is written: a local rank polling would hold the baton, so it
        waits here (a key never written is a deadlock, reported rank by rank)."""
        self._wait(list(keys))
        return True

    def add(self, key: str, amount: int) -> int:
        with self.world.cond:
            value = int(self.world.kv.get(key, b"0")) + amount
            self.world.kv[key] = str(value).encode()
            self.world.cond.notify_all()
            return value

    def delete_key(self, key: str) -> bool:
        with self.world.cond:
            return self.world.kv.pop(key, None) is not None
