"""Parameters ZeRO holds as rows, made whole for a block: what reads them collectively
outside a plan's own gathers (a state dict, a load, another graph's plan) runs inside
`whole_parameters` (See NOTE: ZeRO stage 3 and NOTE: ZeRO with master parameters in zero.py).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List, Optional

import torch

from .zero_packed import gather_rows
from .zero_shard import Shard


_ANY_HELD = False   # whether this process has held any parameter as stage-3 rows


def hold_seen() -> None:
    global _ANY_HELD
    _ANY_HELD = True


def any_held() -> bool:
    """Whether this process has held any parameter as stage-3 rows (nothing to look at if not)."""
    return _ANY_HELD


def held(p: torch.nn.Parameter) -> Optional[Shard]:
    """The Shard of a parameter ZeRO stage 3 holds (the first executable's: every executable
    of a graph shards a parameter alike); None for any other."""
    return getattr(p, "_graphc_zero3", None)


def released_in(params) -> List[torch.nn.Parameter]:
    """Those of `params` that ZeRO stage 3 holds as shards now (their whole storage freed).
    Asked every step: nothing to look at until some parameter is held (_ANY_HELD)."""
    if not _ANY_HELD:
        return []
    return [p for p in params if held(p) is not None and held(p).released]


@contextmanager
def whole_parameters(params) -> Iterator[None]:
    """Collective over each parameter's data-parallel group: within the block the stage-3
    parameters among `params` are whole, and so are the float32 masters ZeRO holds as rows
    (set_param_dtype); after it, the rows written are kept in the shards, each such parameter
    is its master rounded again, and what was freed is freed again (See NOTE: ZeRO stage 3,
    NOTE: ZeRO with master parameters). Every rank of a group gathers the same parameters in
    the same order (by name)."""
    params = list(params)
    chosen = _by_group(held(p) for p in params)
    freed = [s for s in chosen if s.released]
    for s in freed:
        s.materialize()
        gather_rows(s, s.param)
    rows_only = _by_group(_master_rows(p) for p in params)
    for s in rows_only:
        s.materialize_master()
        gather_rows(s, s.master)
    try:
        yield
    finally:
        for s in rows_only:      # (stage 3: before its parameter is freed again)
            s.keep_master_rows()
        for s in chosen:
            # (a plan run inside the block may have released it itself; a master's rows are
            # kept from the master, not from their rounding)
            if not s.released and s.master is None:
                s.keep_rows()
        for s in freed:
            s.release()


def _by_group(shards) -> List[Shard]:
    """The distinct shards among `shards` (None skipped), in the order every rank gathers."""
    chosen = list({id(s): s for s in shards if s is not None}.values())
    return sorted(chosen, key=lambda s: (s.ranks, s.name))


def _master_rows(p: torch.nn.Parameter) -> Optional[Shard]:
    """The Shard of a parameter whose float32 master ZeRO holds as rows (set_param_dtype)."""
    return getattr(p, "_graphc_zero_master", None)
