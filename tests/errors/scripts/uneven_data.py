"""Data parallel over ranks whose shards differ in length, without drop_last.

    torchrun --nproc_per_node 2 uneven_data.py

Rank r's DataLoader holds 4 * (3 - r) rows in batches of 4: rank 0 makes 3 steps, rank 1
only 2 and exits normally, while rank 0 calls the graph a third time.
"""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import graphc


class Train(graphc.Graph):
    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    everyone = graphc.placement("cpu", ranks=list(range(world)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    graphc.to_global(model, placement=everyone, sbp=graphc.sbp.broadcast)
    graph = Train(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(rank)
    rows = 4 * (3 - rank)
    data = TensorDataset(torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g))
    for step, (x, y) in enumerate(DataLoader(data, batch_size=4)):
        x = graphc.to_global(x, placement=everyone, sbp=graphc.sbp.split(0))
        y = graphc.to_global(y, placement=everyone, sbp=graphc.sbp.split(0))
        print(f"rank {rank} step {step} loss {graph(x, y).to_local().item():.4f}", flush=True)
    print(f"rank {rank} out of data", flush=True)


if __name__ == "__main__":
    main()
