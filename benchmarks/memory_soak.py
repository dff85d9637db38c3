"""Memory soak: a long 4-stage pipeline run must not grow its resident memory.

    torchrun --nproc_per_node 4 benchmarks/memory_soak.py --steps 500 --warmup 50

Every rank trains SkipNet-style stages (block s on rank s, the first block's output
skipping to the last stage) with 1F1B over 4 micro-batches. After `--warmup` steps each
rank reads its resident set size (VmRSS in /proc/self/status), then again at the end, and
prints the growth; rank 0 prints the largest growth over the ranks and the process exits
non-zero when it exceeds --limit percent (5 by default).
"""
import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import graphc


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return torch.nn.functional.gelu(self.norm(self.linear(x)))


class SkipNet(nn.Module):
    def __init__(self, p: int, d: int, classes: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(p)])
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        first = self.blocks[0](x)
        h = first
        for block in self.blocks[1:]:
            h = block(h)
        return self.head(h + first)


class SoakGraph(graphc.Graph):
    def __init__(self, model: SkipNet, opt, accumulation: int):
        super().__init__()
        self.model = model
        p = len(model.blocks)
        for s in range(p):
            self.model.blocks[s].config.set_stage(s, graphc.placement("cpu", ranks=[s]))
        self.model.head.config.set_stage(p - 1, graphc.placement("cpu", ranks=[p - 1]))
        self.loss_fn = nn.CrossEntropyLoss()
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--limit", type=float, default=5.0, help="largest allowed growth, percent")
    args = parser.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = SkipNet(world, args.dim)
    graph = SoakGraph(model, torch.optim.Adam(model.parameters(), lr=1e-3), args.accumulation)
    batches = [(torch.randn(args.batch, args.dim), torch.randint(0, 10, (args.batch,)))
               for _ in range(8)]
    for step in range(args.steps):
        graph(*batches[step % len(batches)])
        if step + 1 == args.warmup:
            gc.collect()
            warm = rss_kib()
    gc.collect()
    end = rss_kib()
    growth = 100.0 * (end - warm) / warm
    rank = dist.get_rank()
    print(f"memory_soak: rank {rank} rss after warm-up {warm / 1024:.1f} MiB, after "
          f"{args.steps} steps {end / 1024:.1f} MiB, growth {growth:+.2f}%", flush=True)
    growths = [None] * world
    dist.all_gather_object(growths, growth)
    worst = max(growths)
    if rank == 0:
        print(f"memory_soak: max growth {worst:+.2f}% over {world} ranks "
              f"({args.steps} steps, limit {args.limit}%)", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(0 if worst < args.limit else 1)


if __name__ == "__main__":
    main()
