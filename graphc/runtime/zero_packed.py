"""ZeRO's packed collectives: a bucket's rows of every rank in one [d, width] buffer, gathered
or reduce-scattered in one call (the path of stage 1, of a cast gradient and of groups that are
not gloo; gloo's rank-by-rank rows in place are zero_rows.py's). Used by runtime/zero.py."""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Tuple

import torch

from .. import world

if TYPE_CHECKING:
    from .zero import Shard


def launch_rows(shards: List[Shard], dtype: torch.dtype, device) -> tuple:
    """Starts gathering every rank's rows of `shards` (one group's), packed in `dtype`, each
    rank's part of each padded to its largest chunk: (work or None, packed [d, width], this
    rank's part)."""
    d = len(shards[0].ranks)
    width = sum(s.part_numel for s in shards)
    packed = torch.empty((d, width), dtype=dtype, device=device)
    mine = torch.zeros(width, dtype=dtype, device=device)
    at = 0
    for s in shards:
        mine[at:at + s.rows * s.row_numel].copy_(s.view_rows().reshape(-1))
        at += s.part_numel
    return all_gather(packed, mine, shards[0].ranks), packed, mine


def in_place(shards: List[Shard], t: Optional[torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether a bucket's collective can run on `t` itself: one tensor, contiguous, in the
    bucket's dtype, whose rows every rank holds alike (no padding), so [d, rows/d * row]
    is its own layout."""
    if len(shards) != 1 or t is None or t.dtype != dtype or not t.is_contiguous():
        return False
    s = shards[0]
    return s.rows == s.chunk and s.param.shape[0] == s.chunk * len(s.ranks)


def launch_into(shards: List[Shard]) -> tuple:
    """Stage 3: starts gathering every rank's rows of each shard straight into its whole
    parameter (its storage given back first): no packed copy. ([works], None, None). (On
    gloo every bucket goes rank by rank instead: NOTE: ZeRO rows in place.)"""
    works = []
    for s in shards:
        s.materialize()
        blocks = s.param.data.view(len(s.ranks), -1)
        mine = s.shard.data.reshape(-1).to(s.param.dtype)   # a float32 master's rows rounded
        works.append(all_gather(blocks, mine, s.ranks))
    return works, None, None


def gather_rows(s: Shard, into: torch.Tensor) -> None:
    """Every rank's rows of `s` (its shard's, in `into`'s dtype) written into `into`."""
    work, packed, _ = launch_rows([s], into.dtype, into.device)
    if work is not None:
        work.wait()
    s.unpack(packed, into)


def reduce_scatter(out: torch.Tensor, packed: torch.Tensor, ranks: Tuple[int, ...], flat: bool = True):
    """Rank k's `out` = the sum over `ranks` of their `packed[k]`. In the torch world
    asynchronous (it overlaps the rest of the backward), the flat form unless `flat` is False:
    the list form holds half the flat one's scratch (a unit's gradient, reduced inside the
    backward: NOTE: ZeRO units; on gloo stage 3 reduces rank by rank instead, NOTE: ZeRO rows
    in place); a local world's list form returns when done."""
    w = world.current()
    if len(ranks) == 1:
        out.copy_(packed[0])
        return None
    if isinstance(w, world.TorchWorld) and not flat:
        return w.reduce_scatter(out, list(packed.unbind(0)), ranks, async_op=True)
    if isinstance(w, world.TorchWorld):
        return w.reduce_scatter_from(out, packed.view(-1), ranks, async_op=True)
    w.reduce_scatter(out, list(packed.unbind(0)), ranks)
    return None


def all_gather(packed: torch.Tensor, mine: torch.Tensor, ranks: Tuple[int, ...]):
    """`packed[k]` = rank k's `mine`, on every rank of `ranks`. In the torch world the flat
    form, asynchronous (returns its work); a local world's list form returns when done."""
    w = world.current()
    if len(ranks) == 1:
        packed[0].copy_(mine)
    elif isinstance(w, world.TorchWorld):
        return w.all_gather_into(packed.view(-1), mine, ranks, async_op=True)
    else:
        w.all_gather(list(packed.unbind(0)), mine, ranks)
    return None
