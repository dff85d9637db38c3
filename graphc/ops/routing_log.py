"""The routing of a real step, recorded by the expert-parallel layers as they run.

NOTE: Routing log
With GRAPHC_ROUTING_OUT=DIR in the environment, every rank's expert-parallel layers
(`expert_parallel`, See NOTE: Expert parallel) record, in the first step they run, the
tokens (token-slot pairs) of each micro-batch that this rank routes to each expert: the
counts the layer exchanges first anyway, so recording reads no new value. Each rank writes
DIR/routing_rank<r>.json: {"rank": r, "step": s, "layers": {layer: {micro-batch: [count per
expert]}}} (and, at a fixed capacity, "drops": {layer: {micro-batch: [dropped, pairs]}}).
`graphc plan --simulate --routing DIR` (graphc/tools/routing.py) prices each
layer's token exchanges by these loads and prints tokens per expert per step. A step
recomputed (activation checkpointing) records the same counts again.
"""
from __future__ import annotations

import json
import os
import threading
from typing import Dict

import torch

from .. import env, world
from .random_ops import current_draw

ENV = "GRAPHC_ROUTING_OUT"
_lock = threading.Lock()
_logs: Dict[tuple, dict] = {}   # (folder, rank) -> the log that rank writes


def record_drops(layer: str, dropped: int, pairs: int) -> None:
    """Records the token-slot pairs a layer at a fixed capacity dropped in the running
    micro-batch (NOTE: Expert capacity), beside its routing."""
    _write(lambda log, mb: log.setdefault("drops", {}).setdefault(layer, {}).__setitem__(mb, [dropped, pairs]))


def record_routing(layer: str, counts: torch.Tensor) -> None:
    """Records this rank's per-expert counts of the running micro-batch for `layer`, in the
    first step this rank runs (a no-op without GRAPHC_ROUTING_OUT)."""
    values = [int(c) for c in counts.tolist()] if env.read(ENV) else None
    _write(lambda log, mb: log["layers"].setdefault(layer, {}).__setitem__(mb, values))


def _write(update) -> None:
    """update(log, micro-batch) on this rank's log of its first step, then the file rewritten."""
    folder = env.read(ENV)
    if not folder:
        return
    _, step, microbatch = current_draw() or (0, 0, 0)
    rank = world.rank()
    with _lock:
        log = _logs.setdefault((folder, rank), {"rank": rank, "step": step, "layers": {}})
        if log["step"] != step:
            return
        update(log, str(microbatch))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"routing_rank{rank}.json"), "w") as f:
            json.dump(log, f)
