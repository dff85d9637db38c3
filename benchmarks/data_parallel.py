"""graphc data parallelism (from SBP) against torch DistributedDataParallel.

    torchrun --nproc_per_node 2 benchmarks/data_parallel.py [--iters 40] [--batch 128]
    python benchmarks/data_parallel.py            # spawns the 2 ranks itself

The same MLP, the same per-rank batch and SGD on 2 ranks over gloo; each iteration
runs one graphc step and one DDP step, alternating, so both see the same machine load.
Prints per-step medians (ms) and the ratio graphc / DDP (target <= 1.0).
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

import graphc


def make_model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(512, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


class DataParallelGraph(graphc.Graph):
    def __init__(self, model, opt, bucket_bytes=None):
        super().__init__()
        self.model = model
        if bucket_bytes:
            self.config.set_gradient_bucket_size(bucket_bytes)
        self.loss_fn = nn.CrossEntropyLoss()
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def bench(iters: int, batch: int, width: int, bucket_mb: float) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    where = graphc.placement("cpu", list(range(world)))
    torch.manual_seed(0)
    base = make_model(width)
    ddp_model = nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=bucket_mb)
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
    model = graphc.to_global(copy.deepcopy(base), placement=where, sbp=graphc.sbp.broadcast)
    graph = DataParallelGraph(model, torch.optim.SGD(model.parameters(), lr=0.01),
                              int(bucket_mb * 2 ** 20))
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 512, generator=g), torch.randint(0, 10, (batch,), generator=g)
    gx = graphc.to_global(x, placement=where, sbp=graphc.sbp.split(0))
    gy = graphc.to_global(y, placement=where, sbp=graphc.sbp.split(0))
    loss_fn = nn.CrossEntropyLoss()

    def ddp_step():
        loss = loss_fn(ddp_model(x), y)
        ddp_opt.zero_grad(set_to_none=True)
        loss.backward()
        ddp_opt.step()
        return loss

    def graphc_step():
        return graph(gx, gy)

    times = {"graphc": [], "ddp": []}
    for i in range(iters + 5):
        for name, step in (("graphc", graphc_step), ("ddp", ddp_step)) if i % 2 else \
                (("ddp", ddp_step), ("graphc", graphc_step)):
            dist.barrier()
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    # both trained on the same data from the same weights: they must agree
    full = graph.full_state_dict()
    for k, v in ddp_model.module.state_dict().items():
        torch.testing.assert_close(full[k], v, atol=1e-4, rtol=1e-4)
    if rank == 0:
        med = {k: statistics.median(v[5:]) * 1e3 for k, v in times.items()}
        print(f"data parallel, {world} ranks (gloo), MLP 512-{width}-{width}-{width}-10, "
              f"batch {batch}/rank, buckets {bucket_mb} MiB, {iters} steps (first 5 dropped)")
        print(f"  graphc median step: {med['graphc']:.2f} ms")
        print(f"  DDP    median step: {med['ddp']:.2f} ms")
        print(f"  ratio graphc / DDP: {med['graphc'] / med['ddp']:.3f}  (target <= 1.0)")


def _spawned(rank: int, world: int, port: int, args) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    bench(args.iters, args.batch, args.width, args.bucket_mb)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--batch", type=int, default=128, help="rows per rank")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="gradient bucket size for both (DDP's bucket_cap_mb)")
    args = parser.parse_args()
    if "RANK" in os.environ:
        torch.set_num_threads(args.threads)
        dist.init_process_group("gloo")
        bench(args.iters, args.batch, args.width, args.bucket_mb)
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
