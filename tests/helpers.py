"""Shared test helpers: real multi-process worlds on gloo, and the eager-PyTorch oracle.

Both sides of the oracle are one helper each: `eager_train` (plain PyTorch on the whole
batch) and `graphc_train` (a Graph called step by step, this rank's losses and the full
state dict), compared by `assert_same_as_eager`. `global_input` makes the GlobalTensor a
rank passes for a whole batch, and `compile_graph` compiles a Graph in one process for the
inputs a call would pass (plain tensors and GlobalTensors), as Graph.__call__ would.

The oracle (one statement, used by every numerics test): graphc must equal single-process
eager PyTorch on the whole batch in float64, within ATOL = RTOL = 1e-10.

Why float64: graphc only reorders floating-point sums (micro-batches, shards, all-reduce
order), so its results differ from eager by rounding alone. In fp32 that rounding depends on
the CPU's kernels (vector width, FMA, blocking), and Adam divides by sqrt(v) and magnifies
the last bits: a suite tuned on one machine failed on another at 1.7e-5. In float64 the
same reordering costs ~1e-16 relative per op, so after a few steps the error is far below
1e-10 on any CPU, while a real bug (a wrong scale, a missing all-reduce) is >= 1e-3.

Every test runs with torch's default dtype set to ORACLE_DTYPE (conftest.py), and so does
every rank run_world spawns, so models, data and optimizer state are float64 unless a test
says otherwise. Tests marked `fp32` form a small smoke set in float32; their tolerance is
FP32_ATOL/FP32_RTOL, justified by the bound in `fp32_bound`.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.multiprocessing as mp

ORACLE_DTYPE = torch.float64
ATOL = 1e-10
RTOL = 1e-10

# fp32 smoke set: a sum of n terms reordered differs by at most ~n * eps * sum|terms|
# (Higham, 2nd ed., 4.2). For the smoke models (n <= 64 terms per dot product, |terms| <= 1,
# 3 SGD steps at lr 0.1), 64 * 1.2e-7 * 3 ~ 2.3e-5 bounds the parameter difference; Adam is
# excluded from the fp32 set because its 1/sqrt(v) magnifies rounding without bound.
FP32_ATOL = 1e-4
FP32_RTOL = 1e-4


def fp32_bound(terms: int, steps: int, eps: float = torch.finfo(torch.float32).eps) -> float:
    """The written error bound of the fp32 smoke set (see above): terms * eps * steps."""
    return terms * eps * steps


# whether the running test is marked world: True or False under pytest, None outside it
# (See NOTE: World marker in conftest.py)
WORLD_TEST = None


def require_world_marker(launcher: str) -> None:
    """Refuses to start ranks from a pytest test not marked @pytest.mark.world."""
    if WORLD_TEST is False:
        raise RuntimeError(f"{launcher} starts ranks in a test not marked @pytest.mark.world: "
                           "mark it (See NOTE: World marker in tests/conftest.py)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world: int, port: int, outdir: str, args: tuple,
           dtype: torch.dtype = ORACLE_DTYPE) -> None:
    torch.set_default_dtype(dtype)  # the parent test's dtype: float64 unless marked fp32
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
    require_world_marker("run_world")
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(fn, world, free_port(), outdir, args,
                                               torch.get_default_dtype()), nprocs=world,
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


def graphc_train(graph, batches: Sequence[tuple], steps: Optional[int] = None,
                 feed: Optional[Callable] = None) -> Tuple[List[float], Dict[str, torch.Tensor]]:
    """The graphc side of the oracle: `graph` trained for `steps` calls (default: one per
    batch), the k-th on batches[k % len(batches)] as eager_train reads them.

    Args:
        feed: feed(*batch) -> the call's inputs on this rank (e.g. GlobalTensors made by
            global_input); None passes the batch as it is.
    Returns:
        (losses, state): the losses this rank holds (a rank whose stages do not hold the
        loss gets an empty tensor and records none) and graph.full_state_dict(), to compare
        with eager_train's by assert_same_as_eager.
    """
    losses = []
    for step in range(len(batches) if steps is None else steps):
        batch = batches[step % len(batches)]
        loss = graph(*(feed(*batch) if feed else batch)).to_local()
        if loss.numel():
            losses.append(loss.item())
    return losses, graph.full_state_dict()


def global_input(whole: torch.Tensor, placement, sbp, rank: Optional[int] = None):
    """`whole` as the GlobalTensor `rank` passes to a graph: its component of `whole` laid out
    as `sbp` on `placement` (rank None: the placement's first rank, as a one-process compile
    reads only the global shape and layout).

    Example:
        x = global_input(torch.randn(8, 4), P01, sbp.split(0), rank)   # rows 4k..4k+3
    """
    import graphc
    from graphc.sbp.layout import local_component
    sbp = sbp if isinstance(sbp, tuple) else (sbp,)
    rank = placement.flat_ranks[0] if rank is None else rank
    return graphc.to_global(local_component(whole, sbp, placement.ranks, rank),
                            placement=placement, sbp=sbp, shape=whole.shape)


def feed_split(placement, rank: int, sbp=None) -> Callable:
    """A graphc_train feed that lays every input of a batch out as `sbp` (default: rows
    split over a 1-D placement) and passes this rank's component."""
    import graphc
    sbp = graphc.sbp.split(0) if sbp is None else sbp
    return lambda *batch: tuple(global_input(t, placement, sbp, rank) for t in batch)


def compile_graph(graph, inputs: Sequence, world: int):
    """compiler.compile in one process for the inputs a call would pass: a plain tensor is a
    whole (broadcast) input, a GlobalTensor gives its global shape and layout; no process
    group, nothing started. Returns the CompiledGraph.

    Example:
        compile_graph(graph, [global_input(x, P01, sbp.split(0)), y], 2)
    """
    from graphc import compiler
    from graphc.executable import input_specs
    specs = input_specs(inputs)
    return compiler.compile(graph, [s.example() for s in specs], world, [s.layout for s in specs])


def accumulate_grads(model, loss_fn: Callable, x, y, m: int) -> float:
    """Eager gradient accumulation over m micro-batches (forward and buffer updates m times):
    backward of each micro-batch's loss / m; returns the step's loss (their sum)."""
    total = 0.0
    for xs, ys in zip(x.chunk(m), y.chunk(m)):
        loss = loss_fn(model(xs), ys) / m
        loss.backward()
        total += loss.item()
    return total


def assert_same_as_eager(losses: Sequence[float], state: Dict[str, torch.Tensor],
                         ref_losses: Sequence[float], ref_state: Dict[str, torch.Tensor],
                         what: str = "") -> None:
    atol, rtol = tolerance()
    assert len(losses) == len(ref_losses), f"{what}: {len(losses)} losses vs {len(ref_losses)}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: losses differ from eager\n{m}")
    assert state.keys() == ref_state.keys(), f"{what}: keys {sorted(state)} vs {sorted(ref_state)}"
    for k in ref_state:
        torch.testing.assert_close(state[k], ref_state[k], atol=atol, rtol=rtol,
                                   msg=lambda m, k=k: f"{what}: parameter {k} differs from eager\n{m}")


def tolerance():
    """(atol, rtol) of the oracle for the current default dtype: 1e-10 in float64."""
    if torch.get_default_dtype() == torch.float64:
        return ATOL, RTOL
    return FP32_ATOL, FP32_RTOL


def assert_close(got, want, what: str = "") -> None:
    """torch.testing.assert_close at the oracle's tolerance."""
    atol, rtol = tolerance()
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{what}\n{m}")


# the attention models' layouts on 2 gloo ranks (tests/passes/test_multihead_attention.py,
# tests/examples/test_nn_transformer.py, test_vit_tensor_parallel.py): tensor parallel
# (sequence-first too, slow) and data parallel; CI runs the batch-first ones
ATTENTION_LAYOUTS = [(True, "tensor"), pytest.param(False, "tensor", marks=pytest.mark.slow), (True, "data")]
ATTENTION_LAYOUT_IDS = ["tensor2", "tensor2_sequence_first", "data2"]


def local_model_state(model):
    """What this rank's own model holds, by its names: its parts of split parameters, the
    stages it does not run as they started. A test's look past the guard that refuses such
    reads in a user's code (NOTE: Parameters held elsewhere): torch functions run without
    the held parameters' __torch_function__."""
    with torch._C.DisableTorchFunctionSubclass():
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
