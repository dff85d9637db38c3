"""The `cpu` preset's host costs, measured here (graphc/tools/network.py stores them).

    PYTHONPATH=. python benchmarks/cpu_calibration.py

On CPU ranks a small layer's time is not its FLOPs: each op dispatched costs a fixed host
time (Python, the dispatcher, autograd's bookkeeping), each plan instruction the runtime's
own, each collective or transfer a hand-off between ranks. Measured side by side in one run,
one torch thread, float64 (what benchmarks/auto_quality.py trains):
  * op_us: the GPT example (8 layers, width 64, 2 x 32 tokens: a data-parallel rank's
    share of auto_quality's batch) compiled for one rank, its forward and backward replayed
    (measure_costs), over 3 x the ops its forward dispatches as device_costs counts them
    (the preset charges a backward twice its forward, as for FLOPs);
  * instruction_us: one rank's step of a 4-wide linear model at 16 micro-batches less at 1,
    per micro-batch, less what measure_costs' replay of its forward and backward takes,
    over its 2 compute instructions: what the runtime adds per instruction;
  * link_gbps: the same all-reduce of 4 MiB: the bandwidth at which collective_seconds'
    2-rank ring (B bytes per member) charges its time per member beyond the 8-byte one's;
  * handoff_us: a local world's barrier over 8 ranks, per wait: one rank runs at a time
    there, and each barrier is 7 waits (every rank but the last to join hands the core on);
    the 2-rank barrier and the ping-pong's time per message, each received by a rank that
    waits for it, are printed beside it;
  * collective_us: the 2-rank all-reduce of 8 bytes less that wait, per member;
  * p2p_us: a message sent before its receiver asks for it, per side (calls sent, then
    received: no wait but the first).
The local world's numbers are the process's CPU time (time.process_time: its threads run
one at a time, so that is their work, and other processes' load, which stretches the wall
time of a wait several times on the shared machine, adds nothing to it); the wall time of
a wait at the load of the run is printed beside. Each is the least of 5 rounds. The load is printed: on a loaded machine every number grows alike, so their ratios (what
ranks layouts against each other) hold better than the numbers.
"""
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import graphc  # noqa: E402
from graphc.runtime.local_world import LocalWorld  # noqa: E402
from gpt import GPT, GPTConfig, lm_loss  # noqa: E402


class _OneRank(graphc.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def build(self, x, y):
        loss = lm_loss(self.model(x), y)
        loss.backward()
        return loss


def op_seconds(repeats: int = 5) -> float:
    """The GPT's one-rank stage replayed (measure_costs) over its ops as device_costs counts
    them (the stage program's, on fake tensors): the preset's forward + backward is 3 x ops."""
    from graphc import compiler
    from graphc.tools.costs import _count_stage, measure_costs
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=32, n_layer=8, n_head=4, n_embd=64))
    x = torch.randint(0, 65, (2, 32))
    compiled = compiler.compile(_OneRank(model), [x, x], 1)
    costs = measure_costs(compiled, repeats=repeats)
    ops = sum(_count_stage(prog, compiled)[0].ops for prog in compiled.programs)
    return (sum(costs.forward.values()) + sum(costs.backward.values())) / (3 * ops)


class _Tiny(graphc.Graph):
    def __init__(self, m: int):
        super().__init__()
        self.model = nn.Linear(4, 4)
        self.config.set_gradient_accumulation_steps(m)
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))

    def build(self, x):
        loss = self.model(x).square().mean()
        loss.backward()
        return loss


def instruction_seconds(repeats: int = 20) -> float:
    from graphc import compiler
    from graphc.tools.costs import measure_costs
    per_call = {}
    for m in (1, 16):
        x = torch.randn(16, 4)
        graph = _Tiny(m)
        times = []
        for _ in range(repeats + 2):
            t0 = time.perf_counter()
            graph(x)
            times.append(time.perf_counter() - t0)
        per_call[m] = statistics.median(times[2:])
        if m == 16:
            costs = measure_costs(compiler.compile(graph, [x], 1), graph._optimizer, repeats=repeats)
            replayed = costs.forward[0] + costs.backward[0]
    per_mb = (per_call[16] - per_call[1]) / 15
    return max(0.0, (per_mb - replayed) / 2)


def local_world_seconds(calls: int = 200, big: int = 1 << 22, clock=time.process_time):
    """Seconds per call on 2 ranks of a local world, by `clock` (the process's CPU time: what
    other processes' load does not add to; or wall time): (an all-reduce of 8 bytes, of
    `big` bytes, a barrier, a message of 8 bytes that its receiver waits for (a ping-pong:
    each hands the core to the other rank), one whose data is there (`calls` sent, then
    received))."""
    def rank_main(rank):
        from graphc import world
        w = world.current()
        times = []
        for n, count in ((8, calls), (big, max(1, calls // 10))):
            t = torch.zeros(n // 8)
            w.barrier()
            t0 = clock()
            for _ in range(count):
                w.all_reduce(t)
            times.append((clock() - t0) / count)
        w.barrier()
        t0 = clock()
        for _ in range(calls):
            w.barrier()
        times.append((clock() - t0) / calls)
        t = torch.zeros(1)
        w.barrier()
        t0 = clock()
        for i in range(calls):     # a ping-pong: each message hands the baton to the other rank
            if rank == 0:
                w.isend(t, 1, tag=2 * i).wait()
                w.irecv(t, 1, tag=2 * i + 1).wait()
            else:
                w.irecv(t, 0, tag=2 * i).wait()
                w.isend(t, 0, tag=2 * i + 1).wait()
        times.append((clock() - t0) / (2 * calls))
        w.barrier()
        t0 = clock()
        for i in range(calls):     # sent ahead: rank 1 finds every message there but the first
            if rank == 0:
                w.isend(t, 1, tag=10 ** 6 + i).wait()
            else:
                w.irecv(t, 0, tag=10 ** 6 + i).wait()
        times.append((clock() - t0) / calls)
        return times
    runs = LocalWorld(2).run(rank_main)
    return tuple(max(r[i] for r in runs) for i in range(5))


def barrier_seconds(ranks: int, calls: int = 200, clock=time.process_time) -> float:
    """Seconds per wait of a barrier over `ranks` local-world ranks (ranks - 1 wait in each):
    a waking rank's cost grows with the ranks that wait beside it."""
    def rank_main(rank):
        from graphc import world
        w = world.current()
        w.barrier()
        t0 = clock()
        for _ in range(calls):
            w.barrier()
        return (clock() - t0) / calls / (ranks - 1)
    return max(LocalWorld(ranks).run(rank_main))


def main(rounds: int = 5, ranks: int = 8) -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    load = os.getloadavg()
    found = []
    for _ in range(rounds):     # the least of each: the one least slowed by other processes
        found.append((op_seconds(), instruction_seconds()) + local_world_seconds()
                     + (barrier_seconds(ranks), local_world_seconds(clock=time.perf_counter)[2],
                        barrier_seconds(ranks, clock=time.perf_counter)))
    op, ins, reduce_s, big_s, barrier_s, pingpong_s, ahead_s, wide_s, wall_s, wide_wall_s = \
        (min(col) for col in zip(*found))
    # a 2-rank barrier is one wait (the first to join hands the core to the other); over
    # `ranks` ranks each of the ranks - 1 waits costs more (the hand-off wakes every waiter):
    # the preset's hand-off is the wide one, as auto_quality's 8 ranks wait
    handoff = wide_s
    member = max(reduce_s - barrier_s, 0.0) / 2
    # a 2-rank ring moves B per member (collective_seconds): the bandwidth that charges the
    # big all-reduce's time per member beyond the small one's
    link = (1 << 22) / max((big_s - reduce_s) / 2, 1e-12)
    print(f"load average {load[0]:.2f} -> {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; "
          "local-world numbers in the process's CPU time")
    print(f"op_us          {op * 1e6:8.1f}   host time per dispatched forward op (backward: 2x)")
    print(f"instruction_us {ins * 1e6:8.1f}   the runtime's time per compute instruction")
    print(f"collective_us  {member * 1e6:8.1f}   per member of a 2-rank all-reduce, its wait aside")
    print(f"link_gbps      {link / 1e9:8.2f}   a 2-rank all-reduce's bytes per second per member")
    print(f"p2p_us         {ahead_s / 2 * 1e6:8.1f}   per side of a send / receive whose data is there")
    print(f"handoff_us     {handoff * 1e6:8.1f}   per wait of a {ranks}-rank barrier (2 ranks: {barrier_s * 1e6:.1f}; "
          f"ping-pong per message {pingpong_s * 1e6:.1f}, all-reduce per call {reduce_s * 1e6:.1f})")
    print(f"               wall time per wait at this load: {wide_wall_s * 1e6:.1f} ({ranks} ranks), "
          f"{wall_s * 1e6:.1f} (2 ranks)")


if __name__ == "__main__":
    main()
