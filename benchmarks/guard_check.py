"""The guard check every graph call runs before its step (NOTE: Guards, NOTE: Grouped guard
check): its cost on the GPT example and a Hugging Face Llama at 4 and 32 layers.

    python benchmarks/guard_check.py [--layers 4 32] [--calls 2000]

One process, float32, one thread. Each graph is compiled once (graph.compile), then
`compiled.guards.failing()` (what a call runs) is timed over --calls calls, with the same
guards checked one by one (sequential_check) beside it when this graphc has it. Prints the
minimum and the median. Works on graphc before the grouped check too (then the one-by-one
column is empty), so two checkouts compare on one machine:

    PYTHONPATH=../main python benchmarks/guard_check.py; PYTHONPATH=. python benchmarks/guard_check.py
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
from frontend import _gpt, _llama  # noqa: E402  the same models as the front end's benchmark


def timed(fn, calls: int):
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e6, statistics.median(times) * 1e6


def measure(name: str, make, batch, calls: int) -> None:
    graph = make(1)
    graph.compile(*batch)
    guards = graph.compiled.guards
    assert guards.failing() is None
    line = f"{name:9s} {len(guards):5d} guards: check {'%6.1f / %6.1f' % timed(guards.failing, calls)} us (min / median)"
    try:
        from graphc.guards.values import sequential_check
    except ImportError:
        sequential_check = None
    if sequential_check is not None:
        one_by_one = sequential_check(guards.guards)
        line += f", one by one {'%6.1f / %6.1f' % timed(lambda: one_by_one({}), calls)} us"
    print(line, flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    for layers in args.layers:
        measure(f"gpt-{layers}", *_gpt(layers), args.calls)
        llama = _llama(layers)
        if llama is not None:
            measure(f"llama-{layers}", *llama, args.calls)


if __name__ == "__main__":
    main()
