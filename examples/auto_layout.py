"""The GPT example on a layout graphc chooses (NOTE: Layout search, graphc/auto/search.py).

    graphc plan examples/auto_layout.py --nproc 8 --out plans --auto --device h100
    torchrun --nproc_per_node 8 examples/auto_layout.py --layout plans/layout.json
    torchrun --nproc_per_node 8 examples/auto_layout.py --auto-parallel h100   # search at run time

The first command searches stages, tensor and data parallelism, ZeRO, the schedule, the
micro-batches and checkpointing for 8 ranks, and writes plans/layout.json, plans/auto.md (the
candidates, their simulated steps and peaks) and the winner's plans. The second trains on it:
the Graph below declares no layout of its own; config.load_layout places everything, and each
rank passes the whole batch (graphc takes the rank's rows). The third searches when the graph
is first called (config.enable_auto_parallel: rank 0 searches, or reads the search cache, and
every rank trains on its layout). Every step's loss is compared
with eager PyTorch on the whole batch.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import graphc  # noqa: E402
from gpt import GPT, GPTConfig, lm_loss  # noqa: E402


class AutoGPT(graphc.Graph):
    def __init__(self, model, optimizer, layout_path=None, auto_device=None):
        super().__init__()
        self.model = model
        if layout_path:
            self.config.load_layout(layout_path)
        elif auto_device:
            self.config.enable_auto_parallel(True, device=auto_device)
        self.add_optimizer(optimizer)

    def build(self, idx, targets):
        loss = lm_loss(self.model(idx), targets)
        loss.backward()
        return loss


def make(args):
    torch.manual_seed(args.seed)
    return GPT(GPTConfig(vocab_size=65, block_size=args.block, n_layer=args.layers,
                         n_head=args.heads, n_embd=args.embd))


def batches(args):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 65, (args.batch, args.block), generator=g),
             torch.randint(0, 65, (args.batch, args.block), generator=g)) for _ in range(args.steps)]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layout", default=None, help="a layout.json from graphc plan --auto")
    p.add_argument("--auto-parallel", default=None, metavar="DEVICE",
                   help="search the layout at the first step for this device preset (h100, cpu, ...)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--embd", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    model = make(args)
    graph = AutoGPT(model, torch.optim.AdamW(model.parameters(), lr=1e-3), args.layout, args.auto_parallel)
    eager = make(args)
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    pairs = []
    for step, (x, y) in enumerate(batches(args)):
        loss = graph(x, y).to_local()
        opt.zero_grad()
        want = lm_loss(eager(x), y)
        want.backward()
        opt.step()
        if loss.numel():     # the rank that holds the loss (the last stage's)
            pairs.append((loss.item(), want.item()))
            print(f"step {step}: graphc {loss.item():.6f} eager {want.item():.6f}", flush=True)
            # float32: the ranks sum in another order than one process does
            assert abs(loss.item() - want.item()) <= 1e-4 * abs(want.item()), pairs[-1]
    return pairs


if __name__ == "__main__":
    main()
