"""The GPT of examples/gpt.py: graphc against eager PyTorch (and torch.compile), tokens per second.

    python benchmarks/gpt.py [--iters 30] [--accumulation 1] [--embd 64]
    python benchmarks/gpt.py --compile --embd 256      # + torch.compile, + compiled stages

One process, the same model, batches and AdamW; each iteration runs one step of every
contender (each trains its own copy of the model), one after the other and each first in
turn, so all see the same machine load. Prints the median step time and tokens/s of each and the ratio graphc /
eager (target <= 1.05: a one-stage graph adds only its plan walk).

--compile adds two contenders: the eager model under `torch.compile(backend="inductor")`
(forward and, through AOTAutograd, backward compiled; AdamW eager, as graphc's), and the
graph with config.set_compile_stages(True) (NOTE: Compiled stages); it prints graphc
compiled / torch.compile and each one's compile time (the first step's, less a median
step). --memory-stats adds the graph with config.set_memory_stats(True) (a Python hook on
every saved tensor): what counting activation bytes costs. Multi-rank tokens/s are printed
by the example itself (`torchrun --nproc_per_node 2 examples/gpt.py --pp 2`).
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import gpt  # noqa: E402


def eager_step(model, opt):
    """One eager training step of `model` (or its torch.compile'd forward)."""
    def step(x, y):
        opt.zero_grad()
        gpt.lm_loss(model(x), y).backward()
        opt.step()
    return step


def graph_step(model, opts, args, compile_stages=False, memory_stats=False):
    graph = gpt.GPTGraph(model, torch.optim.AdamW(model.parameters(), lr=opts.lr), gpt.Layout(),
                         args.accumulation)
    graph.config.set_compile_stages(compile_stages)
    graph.config.set_memory_stats(memory_stats)
    return graph


def contenders(model, opts, args):
    """name -> a function running one training step on its own copy of `model`."""
    fresh = lambda: copy.deepcopy(model)   # noqa: E731 - the same initial weights for each
    ref = fresh()
    out = {"graphc": graph_step(model, opts, args),
           "eager": eager_step(ref, torch.optim.AdamW(ref.parameters(), lr=opts.lr))}
    if args.compile:
        compiled = fresh()
        out["torch.compile"] = eager_step(
            torch.compile(compiled, backend="inductor", fullgraph=True, dynamic=False),
            torch.optim.AdamW(compiled.parameters(), lr=opts.lr))
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
    parser.add_argument("--memory-stats", action="store_true",
                        help="also time a graph counting activation bytes (config.set_memory_stats)")
    args = parser.parse_args(argv)
    ids, vocab = gpt.load_corpus()
    opts = argparse.Namespace(block=32, layers=4, heads=4, embd=args.embd, seed=0, batch=16, lr=3e-3)
    torch.set_num_threads(1)
    runs = contenders(gpt.make_model(vocab, opts), opts, args)
    times = {name: [] for name in runs}
    names = list(runs)
    for i, (x, y) in enumerate(gpt.batches(ids, opts.batch, opts.block, args.warmup + args.iters)):
        for name in names[i % len(names):] + names[:i % len(names)]:   # each goes first in turn
            t0 = time.perf_counter()
            runs[name](x, y)
            times[name].append(time.perf_counter() - t0)
    report(times, args, opts.batch * opts.block)


def report(times, args, tokens):
    med = {k: statistics.median(v[args.warmup:]) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:19s} median {v * 1e3:7.2f} ms/step  {tokens / v:8.0f} tokens/s")
    print(f"graphc/eager = {med['graphc'] / med['eager']:.3f} (width {args.embd}, accumulation "
          f"{args.accumulation}, {args.iters} interleaved steps)")
    if args.compile:
        print(f"graphc compiled / torch.compile = {med['graphc compiled'] / med['torch.compile']:.3f}; "
              f"torch.compile / eager = {med['torch.compile'] / med['eager']:.3f}; "
              f"graphc compiled / graphc = {med['graphc compiled'] / med['graphc']:.3f}")
        for k in ("torch.compile", "graphc compiled"):
            print(f"{k} compile time {times[k][0] - med[k]:.1f} s (first step less a median step)")
    if args.memory_stats:
        print(f"graphc+memory stats / graphc = {med['graphc+memory stats'] / med['graphc']:.3f}")


if __name__ == "__main__":
    main()
