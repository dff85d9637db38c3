"""Model-state bytes per parameter under mixed precision, counted from the tensors themselves.

    python benchmarks/amp_memory.py [--width 512] [--layers 4]

Trains a stack of square Linear layers with AdamW for two steps in each configuration and,
right before the second optimizer step (gradients final, optimizer state present), counts on every rank the distinct storages it holds for the model's state:
the parameters its stage programs read, the tensors the optimizer steps (float32 masters, ZeRO
shards) and their gradients, the optimizer state, and the gradient buffers the runtime keeps
(data-parallel buckets, ZeRO's packed reduce-scatter buckets). A storage shared by several of
them (a gradient viewing a bucket, a ZeRO shard viewing its parameter) counts once. Divided by
the model's parameter count, beside the formula:
  fp32                       4 param + 4 grad + 8 Adam                     = 16
  amp (enable_amp bf16)      the same: master weights are the parameters   = 16
  amp + set_param_dtype bf16 2 param + 4 master + 4 grad + 8 Adam          = 18
  amp + ZeRO-1 over d ranks  4 param + 4 grad bucket + 8 Adam/d           = 8 + 8/d
                             (the shard's gradient views its row of the kept bucket)
  amp + param_dtype + ZeRO-1 2 param + 4 grad bucket + (4 master rows + 8 Adam)/d = 6 + 12/d,
                             Megatron's distributed optimizer
Activations are not model state and are not counted.
"""
import argparse
import os
import socket

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import graphc

CONFIGS = {  # name: (enable_amp, set_param_dtype, ZeRO stage, ranks, formula)
    "fp32": (False, False, 0, 1, "16"),
    "amp bf16": (True, False, 0, 1, "16"),
    "amp bf16 + param_dtype bf16": (True, True, 0, 1, "18"),
    "amp bf16 + ZeRO-1, d=2": (True, False, 1, 2, "8+8/d = 12"),
    "amp + param_dtype bf16 + ZeRO-1, d=2": (True, True, 1, 2, "6+12/d = 12 (Megatron's)"),
}


def make_model(width: int, layers: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


class Step(graphc.Graph):
    def __init__(self, model, opt, amp, param_dtype, zero):
        super().__init__()
        self.model = model
        if amp:
            self.config.enable_amp(True, dtype=torch.bfloat16)
        if param_dtype:
            self.config.set_param_dtype(torch.bfloat16)
        if zero:
            self.config.enable_zero(True, stage=zero)
        self.add_optimizer(opt)

    def build(self, x):
        loss = F.mse_loss(self.model(x), torch.zeros_like(x))
        loss.backward()
        return loss


def held_bytes(graph, opt) -> int:
    """Bytes of the distinct storages of this rank's model state (module docstring)."""
    rt = graph._runtime
    tensors = [p for ex in rt.executors.values() for p in ex.program.module.parameters()]
    tensors += [p for g in opt.param_groups for p in g["params"]]
    tensors += [p.grad for p in list(tensors) if p.grad is not None]
    tensors += [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
    sync = rt.grad_sync
    if sync is not None:
        tensors += list(sync.flats.values()) + list(sync.wides.values())
        tensors += list(getattr(sync, "packed", {}).values())
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def measure(rank, world, name, width, layers, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    amp, param_dtype, zero, _, _ = CONFIGS[name]
    torch.manual_seed(0)
    model = make_model(width, layers)
    numel = sum(p.numel() for p in model.parameters())
    where = graphc.placement("cpu", list(range(world)))
    if world > 1:
        model = graphc.to_global(model, placement=where, sbp=graphc.sbp.broadcast)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    graph = Step(model, opt, amp, param_dtype, zero)
    x = torch.randn(8 * world, width)
    xs = x if world == 1 else graphc.to_global(x.chunk(world)[rank], placement=where,
                                               sbp=graphc.sbp.split(0))
    graph(xs)      # the first step creates the optimizer state
    seen = []
    rt = graph._runtime
    step = rt._step   # right before the second step: every gradient final, none yet dropped

    def counted_step():
        seen.append(held_bytes(graph, opt))
        step()
    rt._step = counted_step
    graph(xs)
    out[rank] = (seen[0], numel)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    print(f"{args.layers} x Linear({args.width}, {args.width}), AdamW; model-state bytes per "
          "parameter on each rank")
    print(f"| {'configuration':<36} | {'measured B/param (per rank)':<28} | formula |")
    print(f"|{'-' * 38}|{'-' * 30}|---------|")
    for name, (_, _, _, world, formula) in CONFIGS.items():
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(measure, args=(world, name, args.width, args.layers, _free_port(), out),
                     nprocs=world)
            per_rank = [out[r][0] / out[r][1] for r in range(world)]
        measured = " / ".join(f"{b:.2f}" for b in per_rank)
        print(f"| {name:<36} | {measured:<28} | {formula} |", flush=True)


if __name__ == "__main__":
    main()
