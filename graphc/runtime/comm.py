"""Point-to-point transport, chosen per channel (one direction of a rank pair).

- shm: ranks on one host with cpu tensors exchange them through shared-memory rings
  (see NOTE: Shared-memory channels in shm.py): a send is one memcpy, no thread hand-off.
- a local world's ranks (threads of one process, NOTE: Worlds in graphc/world.py) hand
  tensors over in memory, through the world itself.
- gloo (cpu) / NCCL (cuda): asynchronous isend/irecv. Gloo matches messages by tag, so
  each tensor carries its sequence number on its channel. NCCL ignores tags and matches
  in issue order per communicator; each direction of a rank pair gets its own
  communicator so a send never queues behind a receive.
GRAPHC_P2P=auto (default) | shm | gloo picks; auto uses shm wherever it can.
"""
from __future__ import annotations

import os
import uuid
from collections import defaultdict
from typing import Dict, Iterable, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import env, world
from ..errors import GraphcError
from ..plan.instructions import Recv, Send
from ..plan.plan import ExecutionPlan
from . import host, shm
from .dist_env import timeout_seconds


def shm_max_bytes() -> int:
    """GRAPHC_SHM_MAX_MB (default 1024): the largest shared-memory ring of one channel."""
    return env.read("GRAPHC_SHM_MAX_MB") * (1 << 20)


class P2P:
    """Issues this rank's point-to-point transfers over each channel's transport."""

    def __init__(self, rank: int, plans: Sequence[ExecutionPlan], whole_world: bool = True):
        """plans: every rank's (whole_world), or only some, this rank's among them (NOTE:
        Plans of some ranks): then the ranks exchange their channels, which every rank must
        know alike to choose each one's transport alike."""
        self.rank = rank
        self.groups: Dict[Tuple[int, int], object] = {}
        self.shm = None
        self.pairs = []
        self.local = None   # a local world's rank: its transfers are in memory
        everyone = world.multi()
        if everyone is None:
            return
        if world.torch_world() is None:
            self.local = everyone
            self.pairs = _own_pairs(rank, plans)
            return
        specs = _channel_specs(plans)
        if not whole_world:
            specs = {pair: spec for part in world.torch_world().all_gather_object(specs)
                     for pair, spec in part.items()}
        self.pairs = sorted(pair for pair in specs if rank in pair)
        cuda_pairs = [pair for pair, (_, _, dev) in specs.items() if dev == "cuda"]
        for src, dst in sorted(cuda_pairs):  # new_group is collective: every rank, same order
            self.groups[(src, dst)] = dist.new_group([src, dst])
        shm_pairs, pids = _shm_pairs(specs)
        if shm_pairs:
            self.shm = shm.ShmTransport(rank, _open_channels(rank, shm_pairs, specs),
                                        timeout_seconds(), pids)

    def _uses_shm(self, pair: Tuple[int, int]) -> bool:
        return self.shm is not None and pair in self.shm.channels

    def isend(self, tensor: torch.Tensor, peer: int, tag: int):
        if self.local is not None:
            return self.local.isend(tensor, peer, tag)
        if self._uses_shm((self.rank, peer)):
            return self.shm.isend(tensor, peer, tag)
        return dist.isend(tensor, peer, group=self.groups.get((self.rank, peer)), tag=tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int):
        if self.local is not None:
            return self.local.irecv(tensor, peer, tag)
        if self._uses_shm((peer, self.rank)):
            return self.shm.irecv(tensor, peer, tag)
        return dist.irecv(tensor, peer, group=self.groups.get((peer, self.rank)), tag=tag)

    @property
    def kinds(self) -> Dict[Tuple[int, int], str]:
        """Which transport each of this rank's channels uses (for printing and tests)."""
        out = {pair: "local" if self.local is not None else "gloo" for pair in self.pairs}
        out.update({pair: "shm" for pair in (self.shm.channels if self.shm else {})})
        out.update({pair: "nccl" for pair in self.groups})
        return out


def _own_pairs(rank: int, plans: Iterable[ExecutionPlan]) -> list:
    """The channels this rank sends or receives on, from its own plan."""
    mine = next(p for p in plans if p.rank == rank)
    return sorted({(rank, i.peer) if isinstance(i, Send) else (i.peer, rank)
                   for i in mine.instructions if isinstance(i, (Send, Recv))})


def _channel_specs(plans: Iterable[ExecutionPlan]) -> Dict[Tuple[int, int], Tuple[int, int, str]]:
    """(src, dst) -> (tensors per step, largest tensor bytes, device type)."""
    count: Dict[Tuple[int, int], int] = defaultdict(int)
    biggest: Dict[Tuple[int, int], int] = defaultdict(int)
    device: Dict[Tuple[int, int], str] = {}
    for plan in plans:
        stage_dev = {s.stage_id: s.device_type for s in plan.stages}
        for ins in plan.instructions:
            if isinstance(ins, Send):
                pair = (plan.rank, ins.peer)
                count[pair] += len(ins.tensors)
                biggest[pair] = max([biggest[pair]] + [t.nbytes for t in ins.tensors])
                device[pair] = stage_dev.get(ins.stage, "cpu")
    return {pair: (count[pair], biggest[pair], device[pair]) for pair in count}


def _shm_pairs(specs) -> Tuple[list, Dict[int, int]]:
    mode = env.read("GRAPHC_P2P")
    max_bytes = shm_max_bytes()  # before the collective below: every rank raises alike
    # collective: every rank gets the same groups, so every rank decides alike for a pair
    groups, free, pids = host.shared_memory_groups(probe=mode != "gloo" and shm.supported())
    me = groups[dist.get_rank()]
    # process ids mean something only on this host: of the ranks that share its memory
    pids = {r: pid for r, pid in enumerate(pids) if groups[r] == me}
    if mode == "gloo" or not shm.supported():
        if mode == "shm":
            raise GraphcError("GRAPHC_P2P=shm needs an x86-64 Linux host with /dev/shm")
        return [], pids
    pairs, used = [], defaultdict(int)
    for (src, dst), (n, nbytes, dev) in sorted(specs.items()):
        ring = shm.ring_bytes(n, nbytes)
        group = groups[src]
        # half of /dev/shm at most: a ring that outgrows tmpfs would fault mid-step
        fits = ring <= max_bytes and used[group] + ring <= free[src] // 2
        if dev == "cpu" and groups[dst] == group and fits:
            pairs.append((src, dst))
            used[group] += ring
        elif mode == "shm":
            raise GraphcError(f"GRAPHC_P2P=shm, but channel rank {src} -> rank {dst} cannot use "
                              f"shared memory (same host and /dev/shm: {groups[src] == groups[dst]}, "
                              f"see NOTE: Same host in runtime/host.py; device {dev}, "
                              f"{n * nbytes} bytes per step)")
    return pairs, pids


def _open_channels(rank: int, pairs, specs) -> Dict[Tuple[int, int], shm.ShmChannel]:
    """Creates the rings (by each sender), maps them on both sides, then unlinks the files.

    Unlinking right after both sides mapped a file means nothing is left in /dev/shm
    however the processes end.
    """
    token = [uuid.uuid4().hex[:12] if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    path = lambda src, dst: f"/dev/shm/graphc-{token[0]}-{src}-{dst}"  # noqa: E731
    mine = [p for p in pairs if rank in p]
    channels = {}
    for src, dst in mine:
        if src == rank:
            channels[(src, dst)] = shm.ShmChannel(path(src, dst), specs[(src, dst)][0],
                                                  specs[(src, dst)][1], create=True)
    dist.barrier()
    for src, dst in mine:
        if dst == rank:
            channels[(src, dst)] = shm.ShmChannel(path(src, dst), specs[(src, dst)][0],
                                                  specs[(src, dst)][1], create=False)
    dist.barrier()
    for src, dst in mine:
        if src == rank:
            os.unlink(path(src, dst))
    return channels
