"""graphc ZeRO (config.enable_zero) against torch DDP and FSDP2, side by side in one run.

    python benchmarks/zero.py [--iters 30] [--batch 64] [--width 1024] [--layers 8] [--bucket-mib 4]
                              [--only 'graphc zero2,ddp']   # 2 gloo ranks

The same MLP (a ZeRO-sized stack of square Linear layers), the same per-rank batch and Adam
on 2 ranks over gloo. Each iteration runs one step of every contender, in an order that
rotates, so all see the same machine load:
  graphc data parallel (replicated, all-reduce), graphc ZeRO stage 2, graphc ZeRO stage 3
  (parameters held as shards between uses; the whole stage gathered once per step), graphc
  ZeRO stage 3 per unit (zero3u: unit_bytes=1, a unit per Linear; NOTE: ZeRO units),
  torch DistributedDataParallel,
  torch.distributed.fsdp.fully_shard (FSDP2: ZeRO-3, one unit per Linear and the root).
With --bf16 also graphc ZeRO-3 per unit with set_param_dtype(torch.bfloat16) (bf16 gathers,
float32 masters and reduce-scatters) and FSDP2 with the same MixedPrecisionPolicy.
Prints per-step medians (ms), the ratios graphc ZeRO-2 / DDP (target <= 1.05), graphc
ZeRO-3 / FSDP2 (target <= 1.0) and per-unit ZeRO-3 / FSDP2 (step <= 1.0, high-water = held +
peak <= 0.9), and memory per rank:
  held   bytes resident once a contender is built and has stepped twice (its parameters,
         optimizer state and whatever buffers it keeps between steps: RSS growth, measured
         one contender after another with glibc's mmap threshold fixed so that freed
         tensors go back to the system);
  peak   the highest RSS during a step above the RSS before it (VmHWM, reset before every
         step through /proc/self/clear_refs): gradients, packed buckets, gathers.
"""
import argparse
import copy
import os
import statistics
import sys
import time

# large tensors are mmapped and unmapped on free, so RSS follows live tensor bytes
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import graphc  # noqa: E402


def make_model(width: int, layers: int) -> nn.Module:
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


class Graph(graphc.Graph):
    def __init__(self, model, opt, zero, bucket_bytes=None, unit_bytes=0, param_dtype=None):
        super().__init__()
        self.model = model
        if param_dtype is not None:
            self.config.set_param_dtype(param_dtype)
        if bucket_bytes:
            self.config.set_gradient_bucket_size(bucket_bytes)
        if zero:
            self.config.enable_zero(True, stage=zero, unit_bytes=unit_bytes)
        self.loss_fn = nn.CrossEntropyLoss()
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _cpu() -> float:
    return time.process_time()   # every thread of the process, user + system


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _contenders(base, width, batch, rank, world, bucket_bytes=None, bf16=False):
    where = graphc.placement("cpu", list(range(world)))
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)
    gx = graphc.to_global(x, placement=where, sbp=graphc.sbp.split(0))
    gy = graphc.to_global(y, placement=where, sbp=graphc.sbp.split(0))
    loss_fn = nn.CrossEntropyLoss()
    adam = lambda params: torch.optim.Adam(params, lr=1e-4)  # noqa: E731

    def graphc_run(zero, unit_bytes=0, param_dtype=None):
        model = graphc.to_global(copy.deepcopy(base), placement=where, sbp=graphc.sbp.broadcast)
        graph = Graph(model, adam(model.parameters()), zero, bucket_bytes, unit_bytes, param_dtype)
        feed = (gx, gy) if param_dtype is None else (
            graphc.to_global(x.to(param_dtype), placement=where, sbp=graphc.sbp.split(0)), gy)
        return lambda: graph(*feed), graph.full_state_dict

    def torch_run(wrap):
        model = wrap(copy.deepcopy(base))
        opt = adam(model.parameters())

        def step():
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss
        return step, model

    def fsdp(model, param_dtype=None):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh("cpu", (world,))
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=mp)
        return fully_shard(model, mesh=mesh, mp_policy=mp)

    bf16_runs = {   # bf16 parameters gathered, float32 masters and gradient reduction
        "graphc zero3u bf16": lambda: graphc_run(3, unit_bytes=1, param_dtype=torch.bfloat16),
        "fsdp2 bf16": lambda: torch_run(lambda m: fsdp(m, torch.bfloat16))} if bf16 else {}
    return {"graphc dp": lambda: graphc_run(0), "graphc zero2": lambda: graphc_run(2),
            "graphc zero3": lambda: graphc_run(3),
            # a unit per Linear, as FSDP2's below (NOTE: ZeRO units)
            "graphc zero3u": lambda: graphc_run(3, unit_bytes=1),
            "ddp": lambda: torch_run(lambda m: nn.parallel.DistributedDataParallel(m)),
            "fsdp2": lambda: torch_run(fsdp), **bf16_runs}


def bench(iters: int, batch: int, width: int, layers: int, bucket_mib: float = 0, bf16: bool = False,
          only: str = "") -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = make_model(width, layers)
    makers = _contenders(base, width, batch, rank, world, int(bucket_mib * 2**20) or None, bf16)
    if only:   # a subset (graphc dp always: the others are checked against it)
        keep = {"graphc dp", *(n.strip() for n in only.split(","))}
        makers = {n: m for n, m in makers.items() if n in keep}
    steps, held, others = {}, {}, {}
    for name, make in makers.items():      # one after another: each one's resident growth
        dist.barrier()
        before = _rss()
        step, other = make()
        for _ in range(2):
            step()
        dist.barrier()
        held[name] = _rss() - before
        steps[name], others[name] = step, other
    names = list(steps)
    times = {n: [] for n in names}
    cpu = {n: [] for n in names}   # this process's CPU seconds (all threads, user + sys)
    peaks = {n: 0 for n in names}
    for i in range(iters + 3):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            dist.barrier()
            before = _rss()
            _reset_hwm()
            start, cpu_start = time.perf_counter(), _cpu()
            steps[name]()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(_cpu() - cpu_start)
            peaks[name] = max(peaks[name], _hwm() - before)
    # the graphc contenders trained like each other (same data, same weights)
    dp = others["graphc dp"]()
    for zero in ("graphc zero2", "graphc zero3", "graphc zero3u"):
        if zero in others:
            z = others[zero]()
            for k in dp:
                torch.testing.assert_close(dp[k], z[k], atol=1e-5, rtol=1e-5)
    med = {n: statistics.median(v[3:]) * 1e3 for n, v in times.items()}
    med_cpu = {n: statistics.median(v[3:]) * 1e3 for n, v in cpu.items()}
    if rank == 0:
        params = sum(p.numel() for p in base.parameters())
        print(f"ZeRO, {world} ranks (gloo, {torch.get_num_threads()} thread/rank), MLP {layers} x "
              f"{width}^2 + head ({params / 1e6:.1f} M fp32 parameters, {params * 4 / 2**20:.0f} MiB), "
              f"Adam, batch {batch}/rank, {iters} rotating steps (first 3 dropped), graphc buckets "
              f"{bucket_mib or 25:g} MiB")
        print(f"  {'contender':18s} {'ms/step':>8s} {'cpu ms':>8s} {'held MiB':>9s} {'peak MiB':>9s}")
        for n in names:
            print(f"  {n:18s} {med[n]:8.2f} {med_cpu[n]:8.2f} {held[n] / 2**20:9.1f} {peaks[n] / 2**20:9.1f}")
        _print_ratios(med, held, peaks)
        print("  cpu ms: rank 0's CPU time in a step, all its threads (compute, gloo's, the kernel's "
              "socket work): on 2 cores shared by 2 ranks the step's wall time follows it")
        _print_ratios(med_cpu, None, None)


def _print_ratios(med, held, peaks) -> None:
    """The ratios whose two contenders ran (--only may leave some out)."""
    def ratio(a: str, b: str, what: str) -> None:
        if a in med and b in med:
            print(f"  {a} / {b} = {med[a] / med[b]:.3f}  {what}")
    ratio("graphc zero2", "ddp", "(target <= 1.10, aim 1.05)")
    ratio("graphc zero3", "fsdp2", "(target <= 1.0)")
    ratio("graphc zero3u", "fsdp2", "step (target <= 1.0)")
    if held is not None and "graphc zero3u" in med and "fsdp2" in med:
        print(f"  graphc zero3u / fsdp2 = "
              f"{(held['graphc zero3u'] + peaks['graphc zero3u']) / (held['fsdp2'] + peaks['fsdp2']):.3f} "
              f"high-water (held + peak; target <= 0.9)")
    ratio("graphc zero2", "graphc dp", "")
    ratio("graphc zero3", "graphc zero2", "")
    ratio("graphc zero3u bf16", "fsdp2 bf16", "step")
    ratio("graphc zero3u bf16", "graphc zero3u", "")


def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    bench(args.iters, args.batch, args.width, args.layers, args.bucket_mib, args.bf16, args.only)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64, help="rows per rank")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bucket-mib", type=float, default=0,
                        help="graphc's gradient bucket size (0: its default, 25 MiB)")
    parser.add_argument("--bf16", action="store_true",
                        help="also graphc ZeRO-3 per unit with set_param_dtype(bf16) and FSDP2 with "
                             "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
    parser.add_argument("--only", default="",
                        help="comma-separated contenders to run beside graphc dp, e.g. 'graphc zero2,ddp'")
    args = parser.parse_args()
    if "RANK" in os.environ:
        torch.set_num_threads(args.threads)
        dist.init_process_group("gloo")
        bench(args.iters, args.batch, args.width, args.layers, args.bucket_mib, args.bf16, args.only)
        dist.destroy_process_group()
        return
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_spawned, args=(2, port, args), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    sys.exit(main())
