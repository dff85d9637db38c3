"""How a compiled piece's backward divides between zero bubble's I and W (NOTE: Split compiled
backward): the GPT's MLP block (width --embd, 512 tokens) as one compiled piece, its backward
timed whole (one kernel program), then as I (input part) and W (weight part).

    python benchmarks/split_backward.py [--embd 256] [--iters 50]

Before the split, I ran the whole backward and W only accumulated: W held none of it.
"""
import argparse
import os
import statistics
import time

import torch
import torch.nn as nn

from graphc.runtime.compiled_split import input_gradients_only
from graphc.runtime.compiled_stages import compile_program
from graphc.runtime.weight_grads import WeightGroups


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def timed(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = mlp(args.embd)
    x = torch.randn(512, args.embd, requires_grad=True)
    whole, _ = compile_program(torch.fx.symbolic_trace(net), 0)
    split, _ = compile_program(torch.fx.symbolic_trace(net), 0, keeps_graph=True)
    ones = torch.ones(512, args.embd)

    def whole_backward():
        y = whole(x)
        torch.autograd.backward([y], [ones])

    parts = {"I": [], "W": []}

    def split_backward():
        y = split(x)
        weights = WeightGroups.find([y], [x], list(net.parameters()))
        weights.keep()
        t0 = time.perf_counter()
        with input_gradients_only():
            torch.autograd.grad([y], [x], [ones], retain_graph=True)
        weights.release()
        t1 = time.perf_counter()
        weights.run([y], [ones])
        parts["I"].append(t1 - t0)
        parts["W"].append(time.perf_counter() - t1)

    whole_backward(), split_backward()   # compile
    parts["I"].clear(), parts["W"].clear()
    forward = timed(lambda: whole(x), args.iters)
    step_whole = timed(whole_backward, args.iters) - forward
    timed(split_backward, args.iters)
    i, w = statistics.median(parts["I"]), statistics.median(parts["W"])
    print(f"MLP width {args.embd}, 512 tokens, one thread, load average {os.getloadavg()[0]:.1f}: "
          f"whole compiled backward {step_whole * 1e3:.2f} ms; split: I {i * 1e3:.2f} ms + "
          f"W {w * 1e3:.2f} ms = {(i + w) * 1e3:.2f} ms, W's share {w / (i + w):.0%}")


if __name__ == "__main__":
    main()
