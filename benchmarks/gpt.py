"""The GPT of examples/gpt.py: graphc against eager PyTorch (and torch.compile), tokens per second.

    python benchmarks/gpt.py [--iters 30] [--accumulation 1] [--embd 64]
    python benchmarks/gpt.py --compile --embd 256      # + torch.compile, + compiled stages
    python benchmarks/gpt.py --compile --amp bf16      # every contender under bf16 autocast

One process, the same model, batches and AdamW; each iteration runs one step of every
contender (each trains its own copy of the model), one after the other and each first in
turn, so all see the same machine load. Prints each one's median step time (wall, and the CPU
time of the thread that ran it: what the step computed, which other processes sharing the
cores stretch in wall time only) and tokens/s, and one line per comparison: graphc / eager
(target <= 1.02, issue 38: a one-stage graph adds only its plan walk) as the ratio of the
medians, its CPU-time twin, and the quartiles of the per-iteration ratios (both ran in the
same iteration) as the spread, with the machine's load average beside it.

--compile adds two contenders: the eager model under `torch.compile(backend="inductor")`
(forward and, through AOTAutograd, backward compiled; AdamW eager, as graphc's), and the
graph with config.set_compile_stages(True) (NOTE: Compiled stages); it prints graphc
compiled / torch.compile and each one's compile time (the first step's, less a median
step). --amp bf16 runs every contender's forward under bf16 autocast (eager and torch.compile
inside `torch.autocast`, the graphs with config.enable_amp; backward outside it, float32
weights). --memory-stats adds the graph with config.set_memory_stats(True) (a Python hook on
every saved tensor): what counting activation bytes costs. Multi-rank tokens/s are printed
by the example itself (`torchrun --nproc_per_node 2 examples/gpt.py --pp 2`).
"""
import argparse
import contextlib
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import gpt  # noqa: E402


def eager_step(model, opt, amp: str = ""):
    """One eager training step of `model` (or its torch.compile'd forward)."""
    autocast = torch.autocast("cpu", gpt.DTYPES[amp]) if amp else contextlib.nullcontext()

    def step(x, y):
        opt.zero_grad()
        with autocast:   # the forward; the backward outside, as graphc's enable_amp
            loss = gpt.lm_loss(model(x), y)
        loss.backward()
        opt.step()
    return step


def graph_step(model, opts, args, compile_stages=False, memory_stats=False):
    graph = gpt.GPTGraph(model, torch.optim.AdamW(model.parameters(), lr=opts.lr), gpt.Layout(),
                         args.accumulation, amp=args.amp)
    graph.config.set_compile_stages(compile_stages)
    graph.config.set_memory_stats(memory_stats)
    return graph


def contenders(model, opts, args):
    """name -> a function running one training step on its own copy of `model`."""
    fresh = lambda: copy.deepcopy(model)   # noqa: E731 - the same initial weights for each
    ref = fresh()
    out = {"graphc": graph_step(model, opts, args),
           "eager": eager_step(ref, torch.optim.AdamW(ref.parameters(), lr=opts.lr), args.amp)}
    if args.compile:
        compiled = fresh()
        out["torch.compile"] = eager_step(
            torch.compile(compiled, backend="inductor", fullgraph=True, dynamic=False),
            torch.optim.AdamW(compiled.parameters(), lr=opts.lr), args.amp)
        out["graphc compiled"] = graph_step(fresh(), opts, args, compile_stages=True)
    if args.memory_stats:
        out["graphc+memory stats"] = graph_step(fresh(), opts, args, memory_stats=True)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--embd", type=int, default=64, help="the model's width (n_embd)")
    parser.add_argument("--compile", action="store_true",
                        help="also time torch.compile and graphc with config.set_compile_stages")
    parser.add_argument("--amp", default="", choices=("", "bf16"),
                        help="every contender's forward under autocast to this dtype")
    parser.add_argument("--memory-stats", action="store_true",
                        help="also time a graph counting activation bytes (config.set_memory_stats)")
    args = parser.parse_args(argv)
    ids, vocab = gpt.load_corpus()
    opts = argparse.Namespace(block=32, layers=4, heads=4, embd=args.embd, seed=0, batch=16, lr=3e-3)
    torch.set_num_threads(1)
    runs = contenders(gpt.make_model(vocab, opts), opts, args)
    times = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    names = list(runs)
    load = os.getloadavg()[0]
    for i, (x, y) in enumerate(gpt.batches(ids, opts.batch, opts.block, args.warmup + args.iters)):
        for name in names[i % len(names):] + names[:i % len(names)]:   # each goes first in turn
            t0, c0 = time.perf_counter(), time.thread_time()
            runs[name](x, y)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.thread_time() - c0)
    report(times, cpu, args, opts.batch * opts.block, (load + os.getloadavg()[0]) / 2)


def ratio_line(a: str, b: str, times, cpu, target: float) -> str:
    """a / b on the median step: wall time, and the CPU time of the thread that ran it (what
    the step itself computed; other processes on the machine's cores stretch wall time only),
    with the spread of the per-iteration ratios (quartiles: a and b ran in the same iteration)."""
    wall = statistics.median(times[a]) / statistics.median(times[b])
    thread = statistics.median(cpu[a]) / statistics.median(cpu[b])
    paired = sorted(x / y for x, y in zip(times[a], times[b]))
    q1, q3 = paired[len(paired) // 4], paired[(3 * len(paired)) // 4]
    verdict = "meets" if wall <= target else "misses"
    return (f"{a} / {b} = {wall:.3f} (CPU time {thread:.3f}; per-iteration ratios, quartiles "
            f"{q1:.3f}-{q3:.3f}): {verdict} the target <= {target}")


def report(times, cpu, args, tokens, load):
    first = {k: v[0] for k, v in times.items()}   # the compile's step
    times = {k: v[args.warmup:] for k, v in times.items()}
    cpu = {k: v[args.warmup:] for k, v in cpu.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:19s} median {v * 1e3:7.2f} ms/step (CPU {statistics.median(cpu[k]) * 1e3:7.2f})"
              f"  {tokens / v:8.0f} tokens/s")
    print(f"one process, width {args.embd}, accumulation {args.accumulation}, "
          f"{'bf16 autocast, ' if args.amp else ''}{args.iters} interleaved "
          f"steps, load average {load:.1f} on {os.cpu_count()} cores")
    print(ratio_line("graphc", "eager", times, cpu, 1.02))
    if args.compile:
        print(ratio_line("graphc compiled", "torch.compile", times, cpu, 1.02))
        print(f"torch.compile / eager = {med['torch.compile'] / med['eager']:.3f}; "
              f"graphc compiled / graphc = {med['graphc compiled'] / med['graphc']:.3f}")
        for k in ("torch.compile", "graphc compiled"):
            print(f"{k} compile time {first[k] - med[k]:.1f} s (first step less a median step)")
    if args.memory_stats:
        print(f"graphc+memory stats / graphc = {med['graphc+memory stats'] / med['graphc']:.3f}")


if __name__ == "__main__":
    main()
