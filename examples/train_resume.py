"""Fault-tolerant 2-stage pipeline training: per-rank checkpoints and automatic resume.

    torchrun --nproc_per_node 2 --max-restarts 1 examples/train_resume.py \\
        --ckpt-dir /tmp/ckpt --steps 12 --save-every 4 --crash-at-step 6

Every `--save-every` steps each rank writes its own shard (graph.state_dict(): its
parameters, optimizer and scheduler state, step count, RNG) with graphc.save (atomic),
into ckpt-dir/step<N>/rank<r>.pt; after a barrier, rank 0 points ckpt-dir/latest at
that step, so `latest` only ever names a checkpoint every rank finished writing.
On start, a rank loads the checkpoint `latest` names, if any, and continues from there.

--crash-at-step N makes rank 1 die (SIGKILL) in step N once: it first creates
ckpt-dir/crashed, and does not crash again when that marker exists. torchrun
(--max-restarts 1) then restarts both ranks, which resume from the last checkpoint.
--out FILE makes rank 0 write the final full model state dict (graph.full_state_dict()).
"""
import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn

import graphc


class Stage(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.linear(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stage0 = Stage(32, 64)
        self.stage1 = nn.Sequential(Stage(64, 64), nn.Linear(64, 10))

    def forward(self, x):
        return self.stage1(self.stage0(x))


class TrainGraph(graphc.Graph):
    def __init__(self, model, optimizer, lr_sch):
        super().__init__()
        self.model = model
        self.model.stage0.config.set_stage(stage_id=0, placement=graphc.placement("cpu", ranks=[0]))
        self.model.stage1.config.set_stage(stage_id=1, placement=graphc.placement("cpu", ranks=[1]))
        self.loss_fn = nn.CrossEntropyLoss()
        self.config.set_gradient_accumulation_steps(2)
        self.add_optimizer(optimizer, lr_sch)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def batch(step: int):
    """The data of step `step`, the same whenever it is drawn (so a resumed run sees it too)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)


def latest_step(ckpt_dir: str):
    path = os.path.join(ckpt_dir, "latest")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return int(f.read().strip())


def save_checkpoint(graph, ckpt_dir: str, step: int, rank: int) -> None:
    step_dir = os.path.join(ckpt_dir, f"step{step}")
    os.makedirs(step_dir, exist_ok=True)
    graphc.save(graph.state_dict(), os.path.join(step_dir, f"rank{rank}.pt"))
    dist.barrier()  # every shard of this step is on disk before `latest` names it
    if rank == 0:
        tmp = os.path.join(ckpt_dir, "latest.tmp")
        with open(tmp, "w") as f:
            f.write(str(step))
        os.replace(tmp, os.path.join(ckpt_dir, "latest"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--crash-at-step", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.makedirs(args.ckpt_dir, exist_ok=True)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    graph = TrainGraph(model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5))
    start = latest_step(args.ckpt_dir) or 0
    rank = int(os.environ["RANK"])
    if start:
        graph.load_state_dict(graphc.load(os.path.join(args.ckpt_dir, f"step{start}", f"rank{rank}.pt")))
        print(f"rank {rank}: resumed from step {start}", flush=True)

    marker = os.path.join(args.ckpt_dir, "crashed")
    for step in range(start, args.steps):
        if step == args.crash_at_step and rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            print(f"rank {rank}: crashing in step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        loss = graph(*batch(step)).to_local()
        if loss.numel():
            print(f"step {step:3d}  loss {loss.item():.6f}", flush=True)
        if (step + 1) % args.save_every == 0:
            save_checkpoint(graph, args.ckpt_dir, step + 1, rank)

    state = graph.full_state_dict()  # collective: every rank takes part
    if args.out and rank == 0:
        graphc.save(state, args.out)


if __name__ == "__main__":
    main()
