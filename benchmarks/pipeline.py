"""graphc's pipeline against torch.distributed.pipelining, and a one-stage graph against eager.

    torchrun --nproc_per_node 2 benchmarks/pipeline.py [--iters 30] [--batch 256]

A. The same 2-stage step (seed MLP, 4 micro-batches, 1F1B, SGD) on 2 ranks over gloo:
   graphc vs torch.distributed.pipelining.Schedule1F1B, alternating step by step.
B. The whole model as a one-stage graph on rank 0 vs a plain eager step on rank 0,
   alternating step by step.
Prints per-step medians (ms) and the ratios (targets: A <= 0.9, B <= 1.05).
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import graphc  # noqa: E402
from pipeline import PipelineGraph, PipelineModule  # noqa: E402

MICROBATCHES = 4


class OneStageGraph(graphc.Graph):
    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.model.config.set_stage(0, graphc.placement("cpu", ranks=[0]))
        self.loss_fn = nn.CrossEntropyLoss()
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def torch_pipeline(model, rank):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    module = model.m_stage0 if rank == 0 else model.m_stage1
    stage = PipelineStage(module, stage_index=rank, num_stages=2, device=torch.device("cpu"))
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=nn.CrossEntropyLoss())

    def step(x, y):
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def eager_step(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()

    def step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def timed(fn, *args) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn(*args)
    dist.barrier()  # a pipeline step ends when its last rank is done
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--recv-window", type=int, default=2, help="graphc receives posted ahead per peer")
    args = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.batch, 1, 28, 28)
    y = torch.randint(0, 10, (args.batch,))
    base = PipelineModule()
    p0, p1 = graphc.placement("cpu", [0]), graphc.placement("cpu", [1])
    gmodel = copy.deepcopy(base)
    graph = PipelineGraph(gmodel, torch.optim.SGD(gmodel.parameters(), lr=0.01), p0, p1,
                          MICROBATCHES, "1f1b")
    graph.config.set_recv_window(args.recv_window)
    graph(x, y)  # compiles and initialises the process group
    rank = dist.get_rank()
    tstep = torch_pipeline(copy.deepcopy(base), rank)
    one_model = copy.deepcopy(base)
    one_graph = OneStageGraph(one_model, torch.optim.SGD(one_model.parameters(), lr=0.01))
    estep = eager_step(copy.deepcopy(base))
    on_rank0 = (lambda f: (lambda *a: f(*a) if rank == 0 else None))

    runs = {"graphc pipeline": lambda: graph(x, y), "torch.pipelining 1F1B": lambda: tstep(x, y),
            "graphc one-stage": lambda: one_graph(x, y), "eager step": on_rank0(estep).__call__}
    runs["eager step"] = lambda: on_rank0(estep)(x, y)
    times = {k: [] for k in runs}
    for i in range(args.warmup + args.iters):
        for name, fn in runs.items():  # interleaved: each round runs every contender once
            t = timed(fn)
            if i >= args.warmup:
                times[name].append(t)
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        kinds = set(graph._runtime.p2p.kinds.values()) or {"gloo"}
        print(f"batch {args.batch}, {MICROBATCHES} micro-batches, {args.iters} iterations, "
              f"world {dist.get_world_size()}, graphc p2p: {'/'.join(sorted(kinds))} "
              f"(torch.pipelining: gloo), {torch.get_num_threads()} thread(s)/rank")
        print(f"{'contender':26s} {'median ms':>10s}")
        for k, v in med.items():
            print(f"{k:26s} {v:10.2f}")
        print(f"A. graphc / torch.distributed.pipelining = "
              f"{med['graphc pipeline'] / med['torch.pipelining 1F1B']:.3f}  (target <= 0.9)")
        print(f"B. graphc one-stage / eager              = "
              f"{med['graphc one-stage'] / med['eager step']:.3f}  (target <= 1.05)")


if __name__ == "__main__":
    main()
