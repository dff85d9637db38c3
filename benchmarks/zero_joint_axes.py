"""ZeRO on data x context parallel (NOTE: ZeRO over joint axes): state, bytes and step time.

    python benchmarks/zero_joint_axes.py [--seq 512] [--steps 6] [--stages 0,2]

examples/long_context.py's HF Llama and AdamW on dp2 x cp2 (ring attention), in the local
world (4 ranks as threads of this process, the plans torchrun's ranks would run), once per
ZeRO stage in --stages, the graphs built side by side and stepped in turn on the same batches
so every stage sees the same machine load. Prints per stage: each rank's optimizer state
(AdamW's exp_avg and exp_avg_sq, counted from the optimizer), the plan's bytes sent per step
by kind (graphc/plan/traffic.py), and the median step time and its ratio to stage 0's.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from graphc.plan.traffic import step_bytes  # noqa: E402
from graphc.runtime.local_world import LocalWorld  # noqa: E402


def state_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim())


def run_rank(rank: int, args, stages, batches):
    """Every stage's graph on this rank, stepped in turn: {stage: (state bytes, step bytes, times)}."""
    import hf_llama
    import long_context as lc
    mesh = lc.Mesh(2, 2, 1)
    graphs = {}
    for zero in stages:
        model = hf_llama.make_model(args.vocab, argparse.Namespace(seed=0, embd=args.embd, layers=args.layers,
                                                                   heads=args.heads, block=args.seq))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        graphs[zero] = (lc.LongContextGraph(model, opt, mesh, "ring", False, zero=zero), opt)
    times = {zero: [] for zero in stages}
    for batch in batches:
        local = lc.rank_batch(mesh, rank, batch)
        for zero, (graph, _) in graphs.items():
            start = time.perf_counter()
            graph(local).to_local()
            times[zero].append(time.perf_counter() - start)
    return {zero: (state_bytes(opt), step_bytes(graph.plan), times[zero][1:])   # the first compiles
            for zero, (graph, opt) in graphs.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--stages", default="0,2")
    args = parser.parse_args(argv)
    import hf_llama
    stages = [int(s) for s in args.stages.split(",")]
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.steps):
        lines = [torch.randint(0, args.vocab, (int(torch.randint(args.seq // 2, args.seq + 1, (1,), generator=g)),),
                               generator=g) for _ in range(args.batch)]
        batches.append(hf_llama.collate(lines, args.seq))
    results = LocalWorld(4).run(lambda rank: run_rank(rank, args, stages, batches))
    base = statistics.median(results[0][stages[0]][2])
    for zero in stages:
        states = [r[zero][0] for r in results]
        median = statistics.median(results[0][zero][2])
        print(f"zero {zero}: optimizer state per rank {states} B ({states[0] / results[0][stages[0]][0]:.3f}x "
              f"stage {stages[0]}'s); bytes sent a step (rank 0) {results[0][zero][1]}; "
              f"step {median * 1e3:.1f} ms median ({median / base:.3f}x)")


if __name__ == "__main__":
    main()
