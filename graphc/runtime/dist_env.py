"""Process-group set-up: graphc initialises torch.distributed itself under torchrun."""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Tuple

import torch
import torch.distributed as dist

from ..errors import GraphcError

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def timeout_seconds() -> float:
    """GRAPHC_TIMEOUT (seconds, default 300): the longest any rank waits on another."""
    try:
        return float(os.environ.get("GRAPHC_TIMEOUT", "300"))
    except ValueError:
        raise GraphcError(f"GRAPHC_TIMEOUT must be a number of seconds, found "
                          f"{os.environ['GRAPHC_TIMEOUT']!r}")


def ensure_process_group(device_types=("cpu",)) -> Tuple[int, int]:
    """(rank, world_size); initialises the default group when torchrun's environment is set.

    Without torchrun's environment and without a group, this is a single process: (0, 1).
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if not all(v in os.environ for v in _TORCHRUN_VARS):
        return 0, 1
    wants_cuda = "cuda" in device_types
    if wants_cuda and not torch.cuda.is_available():
        raise GraphcError("a placement has type \"cuda\" but this machine has no CUDA device; "
                          "use graphc.placement(\"cpu\", ...) or run on GPUs")
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if wants_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_seconds()))
    return dist.get_rank(), dist.get_world_size()


def device_for(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
