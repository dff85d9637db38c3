"""Point-to-point transport costs, measured between two processes on this host.

`measure_transport("shm"|"gloo"|"auto")` times the sender's isend, the receiver's copy
out, the latency and how late a waiting receiver notices its data; the simulator charges
these to the rank that pays them (see graphc/tools/cost_model.py and simulate/).
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import env
from ..errors import GraphcError
from .cost_model import CostModel


@dataclass
class TransportCosts:
    """One point-to-point transport's costs, measured between two processes on this host."""

    kind: str
    send_overhead: float
    send_per_byte: float
    recv_overhead: float
    recv_per_byte: float
    latency: float
    poll_delay: List[Tuple[float, float]]
    # gloo's all-reduce between the two processes, as the link collective_seconds charges
    # (NOTE: Calibrated collectives): (bytes per second, seconds per ring step)
    collective_link: Optional[Tuple[float, float]] = None
    # (seconds of compute before an all-reduce, extra seconds it then takes): NOTE:
    # Collectives in context
    collective_skew: List[Tuple[float, float]] = field(default_factory=list)

    def apply(self, costs: CostModel) -> CostModel:
        link = self.collective_link or costs.collective_link
        return replace(costs, send_overhead=self.send_overhead, send_per_byte=self.send_per_byte,
                       recv_overhead=self.recv_overhead, recv_per_byte=self.recv_per_byte,
                       latency=self.latency, bandwidth=float("inf"), poll_delay=self.poll_delay,
                       sends_complete_on_delivery=self.kind == "gloo", collective_link=link,
                       collective_skew=self.collective_skew or costs.collective_skew,
                       source=costs.source + f", {self.kind} transport"
                       + (" and gloo all-reduce" if self.collective_link else "") + " measured")


def transport_kind(transport: str = "auto") -> str:
    """The transport graphc.runtime.comm uses between cpu ranks on one host."""
    from ..runtime import shm
    if transport == "auto":
        transport = env.read("GRAPHC_P2P")
    if transport == "auto":
        return "shm" if shm.supported() else "gloo"
    if transport not in ("shm", "gloo"):
        raise GraphcError(f"transport must be auto, shm or gloo, found {transport!r}")
    return transport


WAITS_S = (0.0, 2e-4, 5e-4, 1e-3, 2e-3, 4e-3)   # receiver waits at which the delay is measured


def measure_transport(transport: str = "auto", nbytes: int = 1 << 15, repeats: int = 30,
                      threads: int = 1, reduce_bytes: int = 1 << 20) -> TransportCosts:
    """Measures a transport with two spawned processes (one torch thread each).

    Per message size (16 bytes and `nbytes`): the sender's isend() time, the receiver's
    wait() time when the data is already there (its copy out), fitted as fixed + per byte;
    then, with the receiver waiting, how long after isend() returned it sees the data, for
    waits of WAITS_S: the delay at the shortest wait is the latency, the growth over it the
    polling delay (both processes read one clock, CLOCK_MONOTONIC). Then gloo's blocking all-reduce of
    8 bytes and of `reduce_bytes` (the largest gradient bucket), fitted as the link of a
    2-rank ring (NOTE: Calibrated collectives), and of 8 bytes after compute (NOTE:
    Collectives in context).
    """
    import subprocess
    import sys
    import tempfile
    kind = transport_kind(transport)
    nbytes = max(64, -(-nbytes // 4) * 4)
    # a fresh interpreter spawns the pair, so that no caller's __main__ is re-imported there
    child_env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GRAPHC_PLAN", "MASTER_", "TORCHELASTIC")) and
           k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    with tempfile.TemporaryDirectory() as outdir:
        code = (f"from graphc.tools.transport_costs import _spawn_pair; "
                f"_spawn_pair({kind!r}, {nbytes}, {repeats}, {threads}, {outdir!r}, {reduce_bytes})")
        subprocess.run([sys.executable, "-c", code], check=True, env=child_env, timeout=300)
        return TransportCosts(**torch.load(os.path.join(outdir, "transport.pt")))


def _spawn_pair(kind: str, nbytes: int, repeats: int, threads: int, outdir: str,
                reduce_bytes: int = 1 << 20) -> None:
    import torch.multiprocessing as mp
    mp.start_processes(_transport_worker, args=(kind, nbytes, repeats, threads, _free_port(), outdir,
                                                reduce_bytes),
                       nprocs=2, join=True, start_method="spawn")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Gloo:
    def isend(self, t, peer, tag=0):
        return dist.isend(t, peer, tag=tag)

    def irecv(self, t, peer, tag=0):
        return dist.irecv(t, peer, tag=tag)


def _transport_worker(rank: int, kind: str, nbytes: int, repeats: int, threads: int,
                      port: int, outdir: str, reduce_bytes: int = 1 << 20) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if kind == "shm":
            from ..runtime import shm
            from ..runtime.comm import _open_channels
            pairs = [(0, 1), (1, 0)]
            channels = _open_channels(rank, pairs, {p: (4, nbytes, "cpu") for p in pairs})
            tp = shm.ShmTransport(rank, channels, 60.0)
        else:
            tp = _Gloo()
        peer, tag = 1 - rank, [0]

        def send(t):
            tag[0] += 1
            return tp.isend(t, peer, tag[0])

        def recv(t):
            tag[0] += 1
            return tp.irecv(t, peer, tag[0])

        ready = {}
        for n in (16, nbytes):
            t = torch.randn(n // 4)
            s_times, r_times = [], []
            for _ in range(repeats + 1):
                w = recv(t) if rank == 1 else None
                dist.barrier()
                if rank == 0:
                    t0 = time.perf_counter()
                    w = send(t)
                    s_times.append(time.perf_counter() - t0)
                    w.wait()
                else:
                    time.sleep(2e-3)    # the data is surely there: time the copy out only
                    t0 = time.perf_counter()
                    w.wait()
                    r_times.append(time.perf_counter() - t0)
                dist.barrier()
            ready[n] = statistics.median((s_times or r_times)[1:])
        both = [None, None]
        dist.all_gather_object(both, ready)
        sent, got = both
        delays = []
        t = torch.randn(nbytes // 4)
        for wait in WAITS_S:
            d = []
            for _ in range(repeats + 1):
                w = recv(t) if rank == 1 else None
                dist.barrier()
                if rank == 0:
                    time.sleep(wait)
                    w = send(t)
                    stamp = time.perf_counter()
                    w.wait()
                else:
                    t0 = time.perf_counter()
                    w.wait()
                    stamp = time.perf_counter()
                    stamp = (t0, stamp)
                pair = [None, None]
                dist.all_gather_object(pair, stamp)
                sent_at, (began, seen) = pair
                d.append((sent_at - began, seen - sent_at - got[nbytes]))
            d = d[1:]
            delays.append((statistics.median(x for x, _ in d), statistics.median(y for _, y in d)))
        link = _all_reduce_link(reduce_bytes, repeats)
        skew = _collective_skew(repeats)
        if rank == 0:
            fit = lambda c: (max(0.0, c[16] - 16 * (c[nbytes] - c[16]) / (nbytes - 16)),  # noqa: E731
                             max(0.0, (c[nbytes] - c[16]) / (nbytes - 16)))
            latency = max(0.0, delays[0][1])
            poll = [(max(w, 0.0), max(0.0, x - latency)) for w, x in delays[1:]]
            (so, sb), (ro, rb) = fit(sent), fit(got)
            torch.save(dict(kind=kind, send_overhead=so, send_per_byte=sb, recv_overhead=ro,
                            recv_per_byte=rb, latency=latency, poll_delay=sorted(poll),
                            collective_link=link, collective_skew=skew),
                       os.path.join(outdir, "transport.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# NOTE: Calibrated collectives
# The simulator charges an all-reduce collective_seconds over a (bandwidth, latency) link
# (graphc/tools/network.py): for 2 ranks the ring's B / bandwidth + 2 x latency. On a CPU
# host that link is gloo over loopback, whose costs (a per-call overhead of tens of
# microseconds, memory copies and the sum at a few GB/s) no datasheet gives: the defaults
# CPU_LINK_* modelled data parallel's gradient all-reduce too cheap (a 2-rank data-parallel
# step predicted 0.75 of the measured). measure_transport times gloo's blocking all-reduce
# of 8 bytes and of the largest gradient bucket between its two processes, and fits the
# link so that collective_seconds gives those two times: bandwidth = (B1 - B0) / (t1 - t0),
# latency = (t0 - B0 / bandwidth) / 2. A group of more ranks then scales by the ring's step
# count, as on a GPU.
def _all_reduce_link(reduce_bytes: int, repeats: int) -> Tuple[float, float]:
    """(bandwidth, latency) of gloo's all-reduce here, fitted to 8 bytes and `reduce_bytes`
    (medians, the slower rank's); both ranks call it."""
    sizes = (8, max(64, reduce_bytes))
    times = []
    for n in sizes:
        t = torch.zeros(max(1, n // 4))
        d = []
        dist.barrier()
        for _ in range(repeats + 1):   # back to back, as a step's buckets run: no barrier's skew
            t0 = time.perf_counter()
            dist.all_reduce(t)
            d.append(time.perf_counter() - t0)
        times.append(statistics.median(d[1:]))
    both = [None, None]
    dist.all_gather_object(both, times)
    return link_through(sizes, [max(a, b) for a, b in zip(*both)])


def link_through(sizes: Sequence[int], seconds: Sequence[float]) -> Tuple[float, float]:
    """The (bandwidth, latency) under which a 2-rank all-reduce of sizes[i] bytes takes
    seconds[i] by collective_seconds (NOTE: Calibrated collectives); a time that does not
    grow with size (noise) gives an unbounded bandwidth, a negative latency zero."""
    (b0, b1), (t0, t1) = sizes, seconds
    per_byte = max(0.0, (t1 - t0) / (b1 - b0))
    bandwidth = 1.0 / per_byte if per_byte > 0 else float("inf")
    return bandwidth, max(0.0, (t0 - b0 * per_byte) / 2)


# NOTE: Collectives in context
# A blocking collective finishes when its last member joins, and the simulator has every
# member of a symmetric layout (data or tensor parallel) join at once: their computes cost
# the same. On a host whose cores are shared, the ranks' computes are preempted at random,
# so they drift apart by the time they meet, and the early member, blocked, gives its core
# away and must get it back once the last one joins: a collective issued after compute
# costs more than the back-to-back ones NOTE: Calibrated collectives measures, the more the
# longer the members computed since they last met (at load 3 on the 2-core build machine,
# an 8-byte all-reduce took 0.25 ms back to back, 0.35 after 0.5 ms of compute on each
# rank, 0.76 after 2 ms, 1.5 after 5 ms; traces of tensor 2 showed the first forward of a
# step, 7 ms of compute after the last all-reduce, 2-3 ms longer than the others).
# measure_transport measures that drift where the model is used: both processes compute the
# same fixed work for gaps of COMPUTE_GAPS_S, then all-reduce 8 bytes; the median extra over
# the back-to-back all-reduce, at the median measured compute, is a point of
# CostModel.collective_skew (made non-decreasing: `monotone`). The simulator adds skew(c) to each collective, c the most
# compute any member did since its previous collective (CostModel.skew: interpolated, in
# proportion beyond the last point), and to the first Prologue all-reduce of a step (NOTE:
# Prologue costs). The drift is the machine's at the time of measuring, as the concurrent
# replay's compute is (NOTE: Concurrent replay): a quiet machine measures little.
COMPUTE_GAPS_S = (5e-4, 2e-3, 8e-3, 3.2e-2)


def _collective_skew(repeats: int) -> List[Tuple[float, float]]:
    """(median compute seconds, median extra seconds of an 8-byte all-reduce after it) per
    gap of COMPUTE_GAPS_S, the slower rank's (See NOTE: Collectives in context); both ranks call it."""
    work, t = _Work(), torch.zeros(2)
    back_to_back = _all_reduce_after(t, work, 0.0, repeats)[1]
    points = []
    for gap in COMPUTE_GAPS_S:
        computed, reduced = _all_reduce_after(t, work, gap, repeats)
        points.append((computed, max(0.0, reduced - back_to_back)))
    both = [None, None]
    dist.all_gather_object(both, points)
    return monotone([(max(c0, c1), max(e0, e1)) for (c0, e0), (c1, e1) in zip(*both)])


def monotone(points: Sequence[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The least-squares non-decreasing fit of (x, y) points sorted by x (pool adjacent
    violators): more compute before a collective drifts its members at least as far apart,
    so a smaller extra measured after a longer gap is noise, averaged with its neighbour
    (See NOTE: Collectives in context)."""
    blocks: List[List[float]] = []     # [sum of y, count] per pooled run
    for _, y in points:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    ys = [total / count for total, count in blocks for _ in range(count)]
    return [(x, y) for (x, _), y in zip(points, ys)]


class _Work:
    """A fixed amount of compute (small matmuls on one thread) that takes about the given
    seconds on an idle core: preempted, it takes longer, as a rank's compute does."""

    def __init__(self):
        self.a, self.b = torch.randn(96, 96), torch.randn(96, 96)
        d = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(50):
                torch.mm(self.a, self.b)
            d.append((time.perf_counter() - t0) / 50)
        self.per_matmul = min(d)

    def compute(self, seconds: float) -> None:
        for _ in range(round(seconds / self.per_matmul)):
            torch.mm(self.a, self.b)


def _all_reduce_after(t, work: _Work, seconds: float, repeats: int) -> Tuple[float, float]:
    """(median seconds `work` of `seconds` took, median seconds of the all-reduce after it)."""
    computed, reduced = [], []
    dist.barrier()
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        work.compute(seconds)
        t1 = time.perf_counter()
        dist.all_reduce(t)
        reduced.append(time.perf_counter() - t1)
        computed.append(t1 - t0)
    return statistics.median(computed[1:]), statistics.median(reduced[1:])
