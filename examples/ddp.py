"""Data-parallel training (OneFlow's data-parallelism guide, seed example, as a graphc Graph).

    torchrun --nproc_per_node 2 examples/ddp.py

Each rank holds its own two samples; `to_global(..., sbp=split(0))` makes them one global
batch of four. The model is broadcast (every rank has all of w), so SBP inference finds
w's gradient partial_sum and all-reduces it after backward: that is data parallelism,
derived from the layouts rather than from a wrapper. w converges to [[2], [3]].
"""
import torch
import torch.nn as nn

import graphc

TRAIN_X = [torch.tensor([[1, 2], [2, 3]], dtype=torch.float32),
           torch.tensor([[4, 6], [3, 1]], dtype=torch.float32)]
TRAIN_Y = [torch.tensor([[8], [13]], dtype=torch.float32),
           torch.tensor([[26], [9]], dtype=torch.float32)]


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([[0], [0]], dtype=torch.float32))

    def forward(self, x):
        return torch.matmul(x, self.w)


class DataParallelGraph(graphc.Graph):
    def __init__(self, model, optimizer):
        super().__init__()
        self.model = model
        # sum over the global batch of 4: the same loss as the seed's per-rank sums, added
        self.loss_fn = nn.MSELoss(reduction="sum")
        self.add_optimizer(optimizer)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def main(iters: int = 500, lr: float = 0.01):
    """Trains on this rank's samples; returns w (the same on every rank)."""
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else int(__import__("os").environ.get("RANK", 0))
    placement = graphc.placement("cpu", ranks=[0, 1])
    model = graphc.to_global(Model(), placement=placement, sbp=graphc.sbp.broadcast)
    graph = DataParallelGraph(model, torch.optim.SGD(model.parameters(), lr=lr))
    x = graphc.to_global(TRAIN_X[rank], placement=placement, sbp=graphc.sbp.split(0))
    y = graphc.to_global(TRAIN_Y[rank], placement=placement, sbp=graphc.sbp.split(0))
    for i in range(iters):
        loss = graph(x, y).to_local()
        if (i + 1) % 50 == 0 and rank == 0:
            print(f"{i + 1}/{iters} loss:{loss.item():.6g}")
    w = graph.full_state_dict()["w"]
    if rank == 0:
        print(graph.plan)
        print(f"\nw:{w}")
    return w


if __name__ == "__main__":
    main()
