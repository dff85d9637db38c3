"""A 2-stage pipeline training script for torchrun in which one rank fails mid-step.

    torchrun --nproc_per_node 2 faulty_train.py --fail-rank 1 --mode raise --at-step 3

--mode raise: the rank's stage raises inside its backward at step --at-step;
--mode kill:  the rank sends itself SIGKILL there (no chance to report anything);
--mode hang:  the rank stalls there forever (alive, silent: only the timeout can tell);
--mode kill-store-host: the rank SIGKILLs rank 0 (the store host), then itself.
--mode raise-after-store-host: the rank SIGKILLs rank 0, then raises (before its step, under
  run_step, so it reports the failure with the store already gone);
--sleep-rank R --sleep-seconds S: rank R sleeps S seconds before step --at-step (a long
  compute in which it waits on nobody through a transfer).
Every other rank must then exit non-zero promptly instead of waiting forever.
"""
import argparse
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import PipelineGraph, SkipNet, make_batches  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, required=True)
    parser.add_argument("--mode", choices=["raise", "kill", "hang", "kill-store-host", "raise-after-store-host"],
                        required=True)
    parser.add_argument("--at-step", type=int, default=3)
    parser.add_argument("--sleep-rank", type=int, default=-1)
    parser.add_argument("--sleep-seconds", type=float, default=0.0)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = SkipNet(int(os.environ["WORLD_SIZE"]))
    graph = PipelineGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation=2)
    batches = make_batches()
    for step in range(args.at_step + 100):
        if step == args.at_step and rank == args.sleep_rank:
            print(f"rank {rank} sleeping {args.sleep_seconds}s", flush=True)
            time.sleep(args.sleep_seconds)
        if step == args.at_step and rank == args.fail_rank:
            if args.mode == "raise-after-store-host":
                _raise_after_killing_store_host(graph)
            _inject(graph, args.mode)
        x, y = batches[step % len(batches)]
        graph(x, y)
        print(f"rank {rank} finished step {step}", flush=True)


def _raise_after_killing_store_host(graph):
    from graphc.runtime.watchdog import run_step

    def fail():
        print(f"injecting raise at {time.time():.3f}", flush=True)
        os.kill(graph._runtime.p2p.shm.pids[0], signal.SIGKILL)
        time.sleep(0.3)  # the store is surely gone
        raise ValueError("injected failure after the store host died")

    run_step(fail)


def _inject(graph, mode):
    executor = graph._runtime.executor

    def failing_backward(mb, grads):
        print(f"injecting {mode.split('-')[0]} at {time.time():.3f}", flush=True)
        if mode == "kill-store-host":
            os.kill(graph._runtime.p2p.shm.pids[0], signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "hang":
            time.sleep(3600)
        raise ValueError("injected failure in backward")

    executor.backward = failing_backward


if __name__ == "__main__":
    main()
