"""Autocast regions in stage programs: the state build() traced a node in, set where it changes.

NOTE: Autocast regions
`with torch.autocast(device, dtype):` inside build() (or in a module's forward) is a Python
context manager, which fx does not record: the trace sees the casts only through the fake
values' dtypes. trace_build therefore stamps each node with the autocast state it was traced
in (META_AUTOCAST: the (device type, dtype) pairs enabled, () for none), and
insert_autocast_modes puts a `set_autocast(state)` call wherever the state changes in a
stage program and `set_autocast(())` before its output. Leaving a region clears torch's
autocast cache, as torch.autocast.__exit__ does: the cache keeps low-precision copies of
parameters, which the optimizer then updates in place, so a kept copy would be stale.
"""
from __future__ import annotations

from typing import Tuple

import torch

DEVICE_TYPES = ("cpu", "cuda")


def autocast_state() -> Tuple[Tuple[str, str], ...]:
    """The autocast regions enabled now, as ((device type, dtype name), ...)."""
    return tuple((d, str(torch.get_autocast_dtype(d)).replace("torch.", ""))
                 for d in DEVICE_TYPES if torch.is_autocast_enabled(d))


def set_autocast(state: Tuple[Tuple[str, str], ...]) -> None:
    """Enters exactly `state` (from autocast_state); () leaves every region."""
    wanted = dict(state)
    for d in DEVICE_TYPES:
        if d in wanted:
            torch.set_autocast_dtype(d, getattr(torch, wanted[d]))
        torch.set_autocast_enabled(d, d in wanted)
    if not wanted:
        torch.clear_autocast_cache()
