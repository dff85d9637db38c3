"""Point-to-point transport: asynchronous isend/irecv on gloo (cpu) or NCCL (cuda).

Gloo matches messages by tag, so each tensor carries its sequence number on its
channel. NCCL ignores tags and matches in issue order per communicator; each direction
of a rank pair gets its own communicator so a send never queues behind a receive.
"""
from __future__ import annotations

from typing import Dict, Iterable, Tuple

import torch
import torch.distributed as dist


class P2P:
    """Issues this rank's point-to-point transfers."""

    def __init__(self, rank: int, pairs: Iterable[Tuple[int, int]], use_nccl: bool):
        self.rank = rank
        self.groups: Dict[Tuple[int, int], object] = {}
        if use_nccl:
            # new_group is collective over the world: every rank creates every pair's groups
            for src, dst in sorted(set(pairs)):
                self.groups[(src, dst)] = dist.new_group([src, dst], use_local_synchronization=False)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int):
        return dist.isend(tensor, peer, group=self.groups.get((self.rank, peer)), tag=tag)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int):
        return dist.irecv(tensor, peer, group=self.groups.get((peer, self.rank)), tag=tag)
