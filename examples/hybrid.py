"""Hybrid parallelism on 4 ranks (OneFlow's global-tensor guide, seed example, trained).

    torchrun --nproc_per_node 4 examples/hybrid.py

Stage 0 runs data parallel on ranks [0, 1]: its input is split(0), its weight broadcast
(so its gradient is all-reduced over [0, 1]). Stage 1 runs model parallel on ranks
[2, 3]: its weight is split(1). Between them `to_global(out0, placement=P23,
sbp=broadcast)` sends each shard of out0 to its peer (0 -> 2, 1 -> 3) and all-gathers it
on [2, 3]. Each step is checked against eager PyTorch on the whole batch.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc

P01 = graphc.placement("cpu", ranks=[0, 1])
P23 = graphc.placement("cpu", ranks=[2, 3])


class StageModule(nn.Module):
    def __init__(self, in_dims, out_dims, placement=None, sbp=None):
        super().__init__()
        self.w = nn.Parameter(torch.randn(in_dims, out_dims))
        if placement is not None:
            graphc.to_global(self.w, placement=placement, sbp=sbp)

    def forward(self, x):
        return torch.matmul(x, self.w)


class ModuleModel(nn.Module):
    def __init__(self, placed: bool = True):
        super().__init__()
        # stage 0: data parallel on ranks 0 and 1; stage 1: model parallel on ranks 2 and 3
        self.m_stage0 = StageModule(5, 8, *((P01, graphc.sbp.broadcast) if placed else ()))
        # 8 x 3 split(1) over 2 ranks: rank 2 holds 2 columns, rank 3 one (torch.chunk's shards)
        self.m_stage1 = StageModule(8, 3, *((P23, graphc.sbp.split(1)) if placed else ()))

    def forward(self, x):
        out_stage0 = self.m_stage0(x)
        # stage 1 needs the whole input, on ranks 2 and 3
        in_stage1 = graphc.to_global(out_stage0, placement=P23, sbp=graphc.sbp.broadcast)
        return out_stage0, self.m_stage1(in_stage1)


class GraphModel(graphc.Graph):
    def __init__(self, model, optimizer, accumulation=2):
        super().__init__()
        self.model = model
        self.model.m_stage0.config.set_stage(stage_id=0, placement=P01)
        self.model.m_stage1.config.set_stage(stage_id=1, placement=P23)
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(optimizer)

    def build(self, x, y):
        out_stage0, out_stage1 = self.model(x)
        loss = F.mse_loss(out_stage1, y)
        loss.backward()
        return out_stage0, out_stage1, loss


def data(steps: int):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)) for _ in range(steps)]


def reference(steps: int):
    """Eager PyTorch on the whole batch, same initial weights."""
    torch.manual_seed(0)
    model = ModuleModel(placed=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for x, y in data(steps):
        loss = F.mse_loss(model.m_stage1(model.m_stage0(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def main(steps: int = 3):
    import torch.distributed as dist
    torch.manual_seed(0)
    model = ModuleModel()
    graph = GraphModel(model, torch.optim.SGD(model.parameters(), lr=0.05))
    losses = []
    for x, y in data(steps):
        rank = dist.get_rank() if dist.is_initialized() else int(__import__("os").environ["RANK"])
        x_local = x.chunk(2)[rank % 2]  # ranks 0/1 hold rows 0-1/2-3; ranks 2/3 pass same shape
        x_in = graphc.to_global(x_local, placement=P01, sbp=graphc.sbp.split(0))
        # the targets are split like the batch, so micro-batch k holds the same rows of both
        y_in = graphc.to_global(y.chunk(2)[rank % 2], placement=P23, sbp=graphc.sbp.split(0))
        out_stage0, out_stage1, loss = graph(x_in, y_in)
        if loss.to_local().numel():
            losses.append(loss.to_local().item())
    print(f"rank {rank}: out_stage0 {list(out_stage0.shape)} {out_stage0.sbp}, out_stage1 "
          f"{list(out_stage1.shape)} {out_stage1.sbp}, losses {losses}")
    ref = reference(steps)
    state = graph.full_state_dict()
    if losses:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), atol=1e-5, rtol=1e-5)
    for k, v in ref["state"].items():
        torch.testing.assert_close(state[k], v, atol=1e-5, rtol=1e-5)
    if rank == 0:
        print(graph.plan)
    return {"losses": losses, "state": state, "reference": ref}


if __name__ == "__main__":
    main()
