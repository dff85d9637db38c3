"""The GPT of examples/gpt.py: graphc against eager PyTorch, tokens per second.

    python benchmarks/gpt.py [--iters 30] [--accumulation 1]

One process, the same model, batches and AdamW; each iteration runs one graphc step and
one eager step (the eager model is a copy), alternating, so both see the same machine
load. Prints the median step time and tokens/s of each and the ratio graphc / eager
(target <= 1.05: a one-stage graph adds only its plan walk). --memory-stats adds a third
contender, the same graph with config.set_memory_stats(True) (a Python hook on every saved
tensor), interleaved with the others: what counting activation bytes costs. Multi-rank tokens/s are printed
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--memory-stats", action="store_true",
                        help="also time a graph counting activation bytes (config.set_memory_stats)")
    args = parser.parse_args(argv)
    ids, vocab = gpt.load_corpus()
    opts = argparse.Namespace(block=32, layers=4, heads=4, embd=64, seed=0, batch=16, lr=3e-3)
    torch.set_num_threads(1)
    model = gpt.make_model(vocab, opts)
    ref = copy.deepcopy(model)
    graph = gpt.GPTGraph(model, torch.optim.AdamW(model.parameters(), lr=opts.lr),
                         gpt.Layout(), args.accumulation)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=opts.lr)
    counted = None
    if args.memory_stats:
        twin = copy.deepcopy(ref)
        counted = gpt.GPTGraph(twin, torch.optim.AdamW(twin.parameters(), lr=opts.lr), gpt.Layout(),
                               args.accumulation)
        counted.config.set_memory_stats(True)
    times = {"graphc": [], "eager": []}
    times.update({"graphc+memory stats": []} if counted is not None else {})
    for i, (x, y) in enumerate(gpt.batches(ids, opts.batch, opts.block, args.warmup + args.iters)):
        t0 = time.perf_counter()
        graph(x, y)
        t1 = time.perf_counter()
        ref_opt.zero_grad()
        gpt.lm_loss(ref(x), y).backward()
        ref_opt.step()
        t2 = time.perf_counter()
        if counted is not None:
            counted(x, y)
        t3 = time.perf_counter()
        if i >= args.warmup:
            times["graphc"].append(t1 - t0)
            times["eager"].append(t2 - t1)
            if counted is not None:
                times["graphc+memory stats"].append(t3 - t2)
    tokens = opts.batch * opts.block
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:19s} median {v * 1e3:7.2f} ms/step  {tokens / v:8.0f} tokens/s")
    print(f"graphc/eager = {med['graphc'] / med['eager']:.3f} (accumulation {args.accumulation}, "
          f"{args.iters} interleaved steps)")
    if counted is not None:
        print(f"graphc+memory stats / graphc = {med['graphc+memory stats'] / med['graphc']:.3f}")


if __name__ == "__main__":
    main()
