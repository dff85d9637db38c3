"""Shared test helpers: real multi-process worlds on gloo, and the eager-PyTorch oracle.

Tolerance: graphc must equal single-process eager PyTorch on the whole batch within
ATOL = RTOL = 1e-5 in fp32 (micro-batching only reorders floating-point sums).
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
from typing import Callable, Dict, List, Sequence

import torch
import torch.multiprocessing as mp

ATOL = 1e-5
RTOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world: int, port: int, outdir: str, args: tuple) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    os.environ.setdefault("GRAPHC_TIMEOUT", "60")
    torch.set_num_threads(1)
    result = fn(rank, world, *args)
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_world(fn: Callable, world: int, *args, timeout: float = 240) -> List:
    """Runs fn(rank, world, *args) in `world` spawned processes, as torchrun would set them up.

    graphc initialises the gloo process group itself from the torchrun variables. Returns
    each rank's return value; raises if any rank fails or the world outlives `timeout`.
    """
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(fn, world, free_port(), outdir, args), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"distributed test did not finish within {timeout}s")
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def eager_train(model: torch.nn.Module, make_opt: Callable, make_sched, loss_fn: Callable,
                batches: Sequence[tuple], steps: int):
    """The oracle: plain eager PyTorch on whole batches. Returns (losses, state dict)."""
    opt = make_opt(model.parameters())
    sched = make_sched(opt) if make_sched else None
    losses = []
    for step in range(steps):
        x, y = batches[step % len(batches)]
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched:
            sched.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_as_eager(losses: Sequence[float], state: Dict[str, torch.Tensor],
                         ref_losses: Sequence[float], ref_state: Dict[str, torch.Tensor],
                         what: str = "") -> None:
    assert len(losses) == len(ref_losses), f"{what}: {len(losses)} losses vs {len(ref_losses)}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=ATOL, rtol=RTOL,
                               msg=lambda m: f"{what}: losses differ from eager\n{m}")
    assert state.keys() == ref_state.keys(), f"{what}: keys {sorted(state)} vs {sorted(ref_state)}"
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], atol=ATOL, rtol=RTOL,
                                   msg=lambda m, k=k: f"{what}: parameter {k} differs from eager\n{m}")
