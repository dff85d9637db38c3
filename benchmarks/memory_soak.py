"""Memory soak: a long 4-stage pipeline run must not grow its resident memory.

    torchrun --nproc_per_node 4 benchmarks/memory_soak.py --steps 500 --warmup 50

Every rank trains tests/models.py's SkipNet (block s on rank s, the first block's output
skipping to the last stage) with 1F1B over 4 micro-batches. After `--warmup` steps each
rank reads its resident set size (VmRSS in /proc/self/status), then again at the end, and
prints the growth; rank 0 prints the largest growth over the ranks and the process exits
non-zero when it exceeds --limit percent (5 by default).
"""
import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from models import PipelineGraph, SkipNet  # noqa: E402  (the tests' 4-stage skip model)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


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
    model = SkipNet(world, args.dim, classes=10)
    graph = PipelineGraph(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                          accumulation=args.accumulation)
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
