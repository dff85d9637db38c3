"""Process-group set-up: graphc initialises torch.distributed itself under torchrun."""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Tuple

import torch
import torch.distributed as dist

from .. import env
from .. import world as worlds
from ..errors import GraphcError
from .agreement import wait_for_ranks

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def timeout_seconds() -> float:
    """GRAPHC_TIMEOUT (seconds, default 300): the longest any rank waits on another."""
    return env.read("GRAPHC_TIMEOUT")


def ensure_process_group(device_types=("cpu",)) -> Tuple[int, int]:
    """(rank, world_size); initialises the default group when torchrun's environment is set.

    Without torchrun's environment and without a group, this is a single process: (0, 1).
    """
    if worlds.current() is not None:   # torch.distributed's group, or a local world (NOTE: Worlds)
        return worlds.rank_and_size()
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
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = _store(rank, world, timeout)
    # every rank says it arrived, so that a rank that never calls a graph is named
    arrived = f"graphc/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/arrived/"
    store.set(arrived + str(rank), "1")
    wait_for_ranks(store, [arrived + str(r) for r in range(world)], timeout.total_seconds(),
                   "the first call of a graph (the process group's set-up)")
    dist.init_process_group(backend=backend, timeout=timeout, store=store, rank=rank, world_size=world)
    return dist.get_rank(), dist.get_world_size()


def _store(rank: int, world: int, timeout: timedelta):
    """The job's c10d store, as torch's env:// set-up makes it, but without its wait for every
    rank to connect: that wait ends in torch's 'Timed out ... 1/2 clients joined', and
    ensure_process_group names the missing ranks instead (See NOTE: Rank agreement).

    After a torchrun restart the store gets a prefix of its own: torchrun's agent store
    keeps the keys the dead attempt's process group wrote, and the default group always
    uses the same prefix, so a restarted rank could read a dead peer's address and its gloo
    connect fails or hangs (seen with torch 2.13 under --max-restarts).
    """
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    hosts = rank == 0 and not agent_hosts
    try:
        store = dist.TCPStore(addr, port, world, is_master=hosts, timeout=timeout,
                              wait_for_workers=False, multi_tenant=True)
    except (dist.DistError, RuntimeError) as e:
        if hosts:
            raise
        host = "torchrun's agent" if agent_hosts else "rank 0"
        raise GraphcError(
            f"rank {rank}: the store at {addr}:{port}, which {host} hosts, did not answer within "
            f"GRAPHC_TIMEOUT ({timeout.total_seconds():g} s) of this rank's first graph call "
            f"({type(e).__name__}). Expected every rank of the job to call the graph; found "
            f"{host} absent: {'it never called a graph, or ' if host == 'rank 0' else ''}"
            "MASTER_ADDR/MASTER_PORT name no store. Fix: call the graph on every rank (a rank "
            "without a stage still calls it), check MASTER_ADDR and MASTER_PORT, or raise "
            "GRAPHC_TIMEOUT if it is only slow.") from e
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return store if attempt == 0 else dist.PrefixStore(f"graphc/attempt{attempt}/", store)


def device_for(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
