"""What a one-process graphc step spends on the host beside eager's work, piece by piece.

    python benchmarks/step_overhead.py [--embd 8] [--steps 200] [--accumulation 1] [--compile]

The GPT of examples/gpt.py at a tiny width (the kernels cost little, so the host's Python
shows), trained by graphc and by eager PyTorch, one step of each in turn. Prints:
- each one's step in CPU time of this thread (time.thread_time: what the step itself ran,
  not the time other processes took the core), minimum and median, and their difference:
  graphc's host overhead per step;
- graphc's pieces (each timed by a wrapper around it, per step, minimum and median over the
  steps), from the call down to the instructions. A piece's time includes the pieces it
  calls (`Runtime.step` holds the whole plan); the wrapper adds ~0.3 us per timed call;
- Python-level function calls per step of each (cProfile over 20 steps).
--compile compares graphc with compiled stages (NOTE: Compiled stages) against torch.compile
instead.
"""
import argparse
import cProfile
import collections
import functools
import importlib
import importlib.util
import os
import pstats
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# benchmarks/gpt.py (its contenders) under its own name: it imports examples/gpt.py as `gpt`
_spec = importlib.util.spec_from_file_location("gpt_benchmark", os.path.join(HERE, "gpt.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
gpt = bench.gpt      # examples/gpt.py

# (module, qualified name): the call's descent (graph.py -> executable -> runtime), then what
# runs around the instructions, then the compute instructions and what they call
PIECES = [
    ("graphc.graph", "Graph.__call__"),
    ("graphc.auto.inputs", "laid_out"),
    ("graphc.executable", "flatten_call"),
    ("graphc.checking.every_step", "StepChecks.before_call"),
    ("graphc.executable_cache", "ExecutableCache.executable_for"),
    ("graphc.executable", "Executable.check"),
    ("graphc.executable", "Executable.call"),
    ("graphc.runtime.actors", "Runtime.step"),
    ("graphc.runtime.grad_hooks", "UserGradHooks.set_aside"),
    ("graphc.runtime.grad_hooks", "UserGradHooks.run"),
    ("graphc.runtime.optimizer_runner", "OptimizerRunner._own_grads"),
    ("graphc.runtime.actors", "Runtime._microbatches"),
    ("graphc.runtime.actors", "Runtime._run_forward"),
    ("graphc.runtime.executor", "StageExecutor.forward"),
    ("graphc.runtime.actors", "Runtime._backward"),
    ("graphc.runtime.executor", "StageExecutor.backward"),
    ("graphc.runtime.actors", "Runtime._run_optimizer_step"),
    ("torch.optim.optimizer", "Optimizer.zero_grad"),
    ("graphc.executable", "Executable.outputs"),
]


def timed_pieces(spent):
    """Wraps every piece so that each call adds its seconds to spent[name]."""
    for module_name, qualname in PIECES:
        owner = importlib.import_module(module_name)
        *path, attr = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        raw = owner.__dict__[attr]
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw
        wrapped = _timer(fn, qualname, spent)
        setattr(owner, attr, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)
        if not path:   # a function imported by name elsewhere: those names too
            for module in list(sys.modules.values()):
                if getattr(module, "__name__", "").startswith("graphc") and getattr(module, attr, None) is fn:
                    setattr(module, attr, wrapped)


def _timer(fn, name, spent):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t0
    return timed


def calls_per_step(step, batches) -> float:
    profile = cProfile.Profile()
    profile.enable()
    for x, y in batches:
        step(x, y)
    profile.disable()
    return sum(v[1] for v in pstats.Stats(profile).stats.values()) / len(batches)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embd", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--compile", action="store_true",
                        help="graphc with compiled stages against torch.compile")
    args = parser.parse_args(argv)
    ours, theirs = ("graphc compiled", "torch.compile") if args.compile else ("graphc", "eager")
    torch.set_num_threads(1)
    ids, vocab = gpt.load_corpus()
    opts = argparse.Namespace(block=32, layers=4, heads=4, embd=args.embd, seed=0, batch=16, lr=3e-3)
    spent = collections.defaultdict(float)
    timed_pieces(spent)   # before the runtime keeps bound methods of its instructions' entries
    runs = bench.contenders(gpt.make_model(vocab, opts), opts,
                            argparse.Namespace(accumulation=args.accumulation, compile=args.compile,
                                               memory_stats=False))
    runs = {ours: runs[ours], theirs: runs[theirs]}
    batches = list(gpt.batches(ids, opts.batch, opts.block, args.steps + 3))
    for x, y in batches[:3]:   # compiled, warm
        for run in runs.values():
            run(x, y)
    cpu = {name: [] for name in runs}
    pieces = collections.defaultdict(list)
    for i, (x, y) in enumerate(batches[3:]):
        for name in list(runs)[i % 2:] + list(runs)[:i % 2]:   # each first in turn
            spent.clear()
            t0 = time.thread_time()
            runs[name](x, y)
            cpu[name].append(time.thread_time() - t0)
            if name == ours:
                for _, piece in PIECES:
                    pieces[piece].append(spent[piece])
    us = lambda v: f"{min(v) * 1e6:9.1f} {statistics.median(v) * 1e6:9.1f}"   # noqa: E731
    print(f"one process, width {args.embd}, accumulation {args.accumulation}, {args.steps} steps each; "
          f"CPU time of the step's thread, us (min, median)")
    for name, v in cpu.items():
        print(f"{name + ' step':42s} {us(v)}")
    diff = [g - e for g, e in zip(cpu[ours], cpu[theirs])]
    print(f"{f'{ours} - {theirs} (same iteration)':42s} {us(diff)}")
    print(f"{ours}: its pieces (wall time inside the step, us: min, median)")
    for _, piece in PIECES:
        print(f"  {piece:40s} {us(pieces[piece])}")
    few = batches[3:23]
    print("Python function calls per step: " + ", ".join(
        f"{name} {calls_per_step(run, few):.0f}" for name, run in runs.items()))


if __name__ == "__main__":
    main()
