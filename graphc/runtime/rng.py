"""The base seed of replica-equal randomness, agreed by every rank of a graph.

See NOTE: Replica-equal randomness in graphc/ops/random_ops.py (the `seeded` op stage
programs call, and `drawing`, which the executor wraps each micro-batch in).
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch

from .. import world


def agree_base_seed(tag: str, timeout: float) -> int:
    """Rank 0's torch.initial_seed(), read by every rank through the c10d store (one set on
    rank 0, one get elsewhere). tag names the graph alike on every rank."""
    seed = torch.initial_seed()
    everyone = world.multi()
    if everyone is None:
        return seed
    store = everyone.store()
    key = f"graphc/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/seed/{tag}"
    if everyone.rank == 0:
        store.set(key, str(seed))
        return seed
    store.wait([key], timedelta(seconds=timeout))
    return int(store.get(key))
