"""Process-group set-up: graphc initialises torch.distributed itself under torchrun."""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Tuple

import torch
import torch.distributed as dist

from ..env import seconds_from_env
from ..errors import GraphcError

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def timeout_seconds() -> float:
    """GRAPHC_TIMEOUT (seconds, default 300): the longest any rank waits on another."""
    return seconds_from_env("GRAPHC_TIMEOUT", 300)


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
    timeout = timedelta(seconds=timeout_seconds())
    store = _restart_store(timeout)
    if store is None:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout, store=store,
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    return dist.get_rank(), dist.get_world_size()


def _restart_store(timeout: timedelta):
    """After a torchrun restart, the store under a prefix of its own; else None (the default).

    torchrun's agent store keeps the keys the dead attempt's process group wrote, and the
    default group always uses the same prefix, so a restarted rank can read a dead peer's
    address and its gloo connect fails or hangs (seen with torch 2.13 under
    --max-restarts). A per-attempt prefix gives every attempt fresh keys.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=(rank == 0 and not agent_hosts), timeout=timeout)
    return dist.PrefixStore(f"graphc/attempt{attempt}/", store)


def device_for(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
