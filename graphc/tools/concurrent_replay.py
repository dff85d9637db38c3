"""Each rank's stage replayed at the same time as the others', one process per rank.

NOTE: Concurrent replay
Ranks of one host compute at the same time and share its cores, caches and memory
bandwidth (and, on a cloud VM, often one physical core's two hyperthreads per pair of
vCPUs), so a stage replayed alone (measure_costs' default) runs faster than the same
stage beside its peers: on the 2-vCPU build machine the 2-rank data- and tensor-parallel
steps were predicted at 0.64-0.76 of the measured median on a quiet machine with every
collective calibrated. `measure_costs(..., concurrent=True)` instead forks one process
per rank of the plan, each replaying its own rank's stage (`_replay_stage`, one torch
thread) while the others replay theirs, the starts lined up by a barrier; a stage's
times are the mean over its ranks. Where the ranks outnumber the cores the processes
also time-share them, as the real run's do, and a machine loaded by other work slows the
replay as it slows the run. Forked (not spawned): the compiled graph is not pickled.
"""
from __future__ import annotations

import multiprocessing as mp
import statistics
from typing import Dict

import torch


def replay_concurrently(compiled, optimizer, repeats: int, threads: int, replay) -> Dict[int, object]:
    """stage -> _StageTimes, every rank replaying its stage in its own forked process at
    once (See NOTE: Concurrent replay); `replay(program, compiled, optimizer, repeats)` times
    one stage (costs._replay_stage, passed in so that this module does not import costs)."""
    ranks = sorted(r for s in compiled.stages for r in s.ranks)
    stage_of = {r: s.stage_id for s in compiled.stages for r in s.ranks}
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(len(ranks)), ctx.Queue()
    procs = [ctx.Process(target=_replay_rank, args=(compiled, optimizer, stage_of[r], repeats, threads,
                                                    barrier, results, replay), daemon=True) for r in ranks]
    for p in procs:
        p.start()
    got = [_next_result(results, procs) for _ in procs]
    for p in procs:
        p.join()
    failed = [err for _, _, err in got if err]
    if failed:
        raise RuntimeError(f"concurrent replay failed in a child process: {failed[0]}")
    by_stage: Dict[int, list] = {}
    for stage, times, _ in got:
        by_stage.setdefault(stage, []).append(times)
    return {s: _mean(ts) for s, ts in by_stage.items()}


def _next_result(results, procs) -> tuple:
    """The next child's (stage, times, error); a child killed before it reported (a signal,
    out of memory) is an error, not a wait forever."""
    import queue
    while True:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead and results.empty():
                return (None, None, f"a replay process exited with code {dead[0]}")


def _replay_rank(compiled, optimizer, stage: int, repeats: int, threads: int, barrier, results,
                 replay) -> None:
    try:
        torch.set_num_threads(threads)
        prog = next(p for p in compiled.programs if p.stage == stage)
        barrier.wait(timeout=600)
        results.put((stage, replay(prog, compiled, optimizer, repeats), ""))
    except BaseException as exc:   # reported by the parent, which is waiting on the queue
        results.put((stage, None, f"{type(exc).__name__}: {exc}"))


def _mean(times: list):
    """The mean of one stage's ranks' times, field by field (None stays None)."""
    first = times[0]
    fields = {}
    for name, value in vars(first).items():
        values = [getattr(t, name) for t in times]
        if value is None or name == "activation":
            fields[name] = value
        else:
            fields[name] = statistics.mean(values)
    return type(first)(**fields)
