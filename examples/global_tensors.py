"""Seed 003's four-rank hybrid program with global tensors, in both of its tabs, trained.

    torchrun --nproc_per_node 4 examples/global_tensors.py               # the global program
    torchrun --nproc_per_node 4 examples/global_tensors.py --set-stage   # the Graph tab

The program is written as OneFlow's guide writes its Eager tab: `w0` lives on ranks [0, 1]
(broadcast), `w1` on ranks [2, 3] (split(1)), the input is split(0) on [0, 1], and one
`to_global(out_stage0, placement=P23, sbp=broadcast)` moves the activation between them.
There is no `set_stage`: every op runs where its inputs and parameters are placed, and
graphc finds the pipeline stages from the placements (stage 0 = ranks [0, 1], stage 1 =
ranks [2, 3]; `print(graph)` and the log say so). With `--set-stage` the same model runs
as the guide's Graph tab, its stages named by `set_stage`; both compile to the same plans.
Each step is checked against eager PyTorch on the whole batch.
"""
import argparse
import os

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
        if placement is not None:  # OneFlow: flow.randn(..., placement=placement, sbp=sbp)
            graphc.to_global(self.w, placement=placement, sbp=sbp)

    def forward(self, x):
        return torch.matmul(x, self.w)


class ModuleModel(nn.Module):
    def __init__(self, placed: bool = True):
        super().__init__()
        # stage 0: data parallel on ranks 0 and 1
        self.m_stage0 = StageModule(5, 8, *((P01, graphc.sbp.broadcast) if placed else ()))
        # stage 1: model parallel on ranks 2 and 3 (the guide's 8 x 3: rank 2 holds 2 columns,
        # rank 3 one, as torch.chunk cuts them)
        self.m_stage1 = StageModule(8, 3, *((P23, graphc.sbp.split(1)) if placed else ()))

    def forward(self, x):
        out_stage0 = self.m_stage0(x)
        # stage 1 needs the whole input, on ranks 2 and 3
        in_stage1 = graphc.to_global(out_stage0, placement=P23, sbp=graphc.sbp.broadcast)
        out_stage1 = self.m_stage1(in_stage1)
        return out_stage0, out_stage1


class GlobalProgram(graphc.Graph):
    """The Eager tab: no set_stage; the placements say where everything runs."""

    def __init__(self, model, optimizer, accumulation=1):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(optimizer)

    def build(self, x, y):
        out_stage0, out_stage1 = self.model(x)
        loss = F.mse_loss(out_stage1, y)
        loss.backward()
        return out_stage0, out_stage1, loss


class GraphModel(GlobalProgram):
    """The Graph tab: the same program with its two stages named."""

    def __init__(self, model, optimizer, accumulation=1):
        super().__init__(model, optimizer, accumulation)
        self.model.m_stage0.config.set_stage(stage_id=0, placement=P01)
        self.model.m_stage1.config.set_stage(stage_id=1, placement=P23)


def data(steps: int):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)) for _ in range(steps)]


def rows_of(t: torch.Tensor, where: graphc.placement, rank: int) -> torch.Tensor:
    """This rank's rows of `t` split(0) over `where`; a rank outside it passes rows of the
    same shape (their values are not read)."""
    ranks = list(where.flat_ranks)
    return t.chunk(len(ranks))[ranks.index(rank) if rank in ranks else 0]


def reference(steps: int):
    """Eager PyTorch on the whole batch, same initial weights (the stages called in turn:
    outside build(), to_global makes a GlobalTensor rather than moving a value)."""
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


def main(steps: int = 3, set_stage: bool = False, accumulation: int = 1):
    torch.manual_seed(0)
    model = ModuleModel()
    program = GraphModel if set_stage else GlobalProgram
    graph = program(model, torch.optim.SGD(model.parameters(), lr=0.05), accumulation)
    rank = int(os.environ["RANK"])
    losses = []
    for x, y in data(steps):
        x_in = graphc.to_global(rows_of(x, P01, rank), placement=P01, sbp=graphc.sbp.split(0))
        # the targets split like the batch, so micro-batch k holds the same rows of both
        y_in = graphc.to_global(rows_of(y, P23, rank), placement=P23, sbp=graphc.sbp.split(0))
        out_stage0, out_stage1, loss = graph(x_in, y_in)
        if loss.to_local().numel():
            losses.append(loss.to_local().item())
    print(f"rank {rank}: out_stage0 {list(out_stage0.shape)} {out_stage0.sbp}, out_stage1 "
          f"{list(out_stage1.shape)} {out_stage1.sbp}, losses {losses}")
    ref = reference(steps)
    state = graph.full_state_dict()
    if losses:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]))
    for k, v in ref["state"].items():
        torch.testing.assert_close(state[k], v)
    if rank == 0:
        print(graph)
    return {"losses": losses, "state": state, "reference": ref, "printed": str(graph)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set-stage", action="store_true", help="the Graph tab: name the stages")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    main(args.steps, args.set_stage, args.accumulation)
