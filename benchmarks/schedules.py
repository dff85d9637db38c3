"""Every pipeline schedule: graphc against torch.distributed.pipelining's class of the same name.

    torchrun --nproc_per_node 2 benchmarks/schedules.py [--iters 20] [--batch 256] [--width 512]

The model is a chain of four blocks (Linear, GELU, Linear; width --width) and a cross-entropy
head, trained with SGD on 8 micro-batches. On 2 ranks, 1f1b and gpipe run two stages (two
blocks each); the chunked schedules run four stages, two per rank (interleaved: stages r and
r + 2 on rank r; V shapes: r and 3 - r). For each schedule three contenders run, interleaved
step by step in one job so that the machine's state is shared alike:

  graphc            graphc's default transport (shared memory between local ranks)
  graphc gloo       graphc with GRAPHC_P2P=gloo: torch's transport
  torch             torch.distributed.pipelining.<Schedule> over gloo

Prints per-step medians (ms) and the ratios graphc / torch (targets: <= 0.9 on graphc's
default transport, <= 1.0 on gloo). A step ends when both ranks are done (barrier).
"""
import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import graphc
from graphc.plan.schedules import ONE_STAGE, V_SHAPED

MICROBATCHES = 8
TORCH_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                 "interleaved_1f1b": "ScheduleInterleaved1F1B", "looped_bfs": "ScheduleLoopedBFS",
                 "zero_bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                 "dualpipev": "ScheduleDualPipeV"}


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class Chain(nn.Module):
    """Four blocks and a head; `stages` groups the blocks into pipeline stages."""

    def __init__(self, width, classes=10):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(4))
        self.head = nn.Linear(width, classes)

    def stages(self, n):
        """n stage modules (2 or 4); the head joins the last."""
        per = 4 // n
        mods = [nn.Sequential(*self.blocks[i * per:(i + 1) * per]) for i in range(n)]
        mods[-1].append(self.head)
        return mods

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def rank_of(schedule, stage, n):
    if schedule in V_SHAPED:
        return stage if stage < n // 2 else n - 1 - stage
    return stage % 2


class ChainGraph(graphc.Graph):
    def __init__(self, model, schedule, n):
        super().__init__()
        self.model = model
        per = 4 // n
        for i in range(4):
            s = i // per
            self.model.blocks[i].config.set_stage(s, graphc.placement("cpu", [rank_of(schedule, s, n)]))
        self.model.head.config.set_stage(n - 1, graphc.placement("cpu", [rank_of(schedule, n - 1, n)]))
        self.config.set_gradient_accumulation_steps(MICROBATCHES)
        self.config.set_pipeline_schedule(schedule)
        self.loss_fn = nn.CrossEntropyLoss()
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.01))

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def graphc_step(base, schedule, n, transport, x, y):
    """A compiled graphc step on `transport` ('auto': graphc's default, or 'gloo')."""
    saved = os.environ.get("GRAPHC_P2P")
    os.environ["GRAPHC_P2P"] = transport
    graph = ChainGraph(copy.deepcopy(base), schedule, n)
    graph(x, y)  # compiles and sets up the transport (read at set-up)
    if saved is None:
        del os.environ["GRAPHC_P2P"]
    else:
        os.environ["GRAPHC_P2P"] = saved
    return lambda: graph(x, y)


def torch_step(base, schedule, n, rank, x, y):
    import torch.distributed.pipelining as pipelining
    from torch.distributed.pipelining import PipelineStage
    model = copy.deepcopy(base)
    mods = model.stages(n)
    mine = [s for s in range(n) if rank_of(schedule, s, n) == rank]
    stages = [PipelineStage(mods[s], stage_index=s, num_stages=n, device=torch.device("cpu"))
              for s in mine]
    params = [p for s in mine for p in mods[s].parameters()]
    opt = torch.optim.SGD(params, lr=0.01)
    cls = getattr(pipelining, TORCH_CLASSES[schedule])
    loss_fn = nn.CrossEntropyLoss()
    sched = cls(stages[0] if schedule in ONE_STAGE else stages, n_microbatches=MICROBATCHES,
                loss_fn=loss_fn)
    first, last = 0 in mine, (n - 1) in mine

    def step():
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": []} if last else {}
        sched.step(*args, **kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--schedules", nargs="+", default=list(TORCH_CLASSES))
    args = ap.parse_args()
    torch.manual_seed(0)
    x, y = torch.randn(args.batch, args.width), torch.randint(0, 10, (args.batch,))
    base = Chain(args.width)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = []
    for schedule in args.schedules:
        n = 2 if schedule in ONE_STAGE else 4
        runs = {"graphc": graphc_step(base, schedule, n, "auto", x, y),
                "graphc gloo": graphc_step(base, schedule, n, "gloo", x, y),
                "torch": torch_step(base, schedule, n, rank, x, y)}
        times = {k: [] for k in runs}
        for i in range(args.warmup + args.iters):
            for name, fn in runs.items():   # interleaved: each round runs every contender once
                t = timed(fn)
                if i >= args.warmup:
                    times[name].append(t)
        rows.append((schedule, n, {k: statistics.median(v) * 1e3 for k, v in times.items()}))
    if rank == 0:
        print(f"batch {args.batch}, width {args.width}, {MICROBATCHES} micro-batches, "
              f"{args.iters} iterations, 2 ranks, {torch.get_num_threads()} thread(s)/rank; ms per step")
        print(f"{'schedule':18s} {'stages':>6s} {'graphc':>8s} {'graphc gloo':>11s} {'torch':>8s} "
              f"{'graphc/torch':>12s} {'gloo/torch':>10s}")
        for schedule, n, med in rows:
            print(f"{schedule:18s} {n:6d} {med['graphc']:8.2f} {med['graphc gloo']:11.2f} "
                  f"{med['torch']:8.2f} {med['graphc'] / med['torch']:12.3f} "
                  f"{med['graphc gloo'] / med['torch']:10.3f}")
        print("targets: graphc/torch <= 0.9 (graphc's default transport), gloo/torch <= 1.0")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
