"""insert_output_reduce: a data-parallel loss (partial_sum over the data ranks) is summed once
per step, after the stage's last compute, in one OUTPUT_ALL_REDUCE of every micro-batch's
value; no stage program reduces it in its forward. Plans only, one process."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from graphc.plan.instructions import COMPUTE, Collective, OptimizerStep, OutputAllReduce
from helpers import compile_graph

M, ROWS = 4, 8


class DataParallel(graphc.Graph):
    def __init__(self, ranks, stages=1, training=True):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
        if stages == 2:   # pipeline 2 x data 2: the loss is partial on the last stage's ranks
            self.model[0].config.set_stage(0, graphc.placement("cpu", ranks[:2]))
            self.model[2].config.set_stage(1, graphc.placement("cpu", ranks[2:]))
        else:
            graphc.to_global(self.model, placement=graphc.placement("cpu", ranks), sbp=sbp.broadcast)
        self.training_plan = training
        self.config.set_gradient_accumulation_steps(M)
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        if self.training_plan:
            loss.backward()
        return loss


def inputs(x_ranks, y_ranks=None):
    """x and y split over their ranks' rows (y where the loss runs)."""
    x_at, y_at = graphc.placement("cpu", x_ranks), graphc.placement("cpu", y_ranks or x_ranks)
    n = ROWS // len(x_ranks)
    return [graphc.GlobalTensor(torch.randn(n, 8), x_at, (sbp.split(0),), (ROWS, 8)),
            graphc.GlobalTensor(torch.randint(0, 3, (n,)), y_at, (sbp.split(0),), (ROWS,))]


def test_the_loss_is_summed_once_after_the_last_compute():
    cg = compile_graph(DataParallel([0, 1]), inputs([0, 1]), 2)
    for plan in cg.plans:
        sums = [i for i in plan.instructions if isinstance(i, OutputAllReduce)]
        assert len(sums) == 1 and sums[0].ranks == (0, 1)
        (loss,) = sums[0].tensors
        assert loss.shape == (M,) and loss.dtype == "float64"   # one row per micro-batch
        assert not [i for i in plan.instructions if isinstance(i, Collective) and i.direction == "F"]
        at = plan.instructions.index(sums[0])
        assert isinstance(plan.instructions[at - 1], COMPUTE)
        assert not [i for i in plan.instructions[at:] if isinstance(i, COMPUTE)]
        assert at < next(i for i, ins in enumerate(plan.instructions) if isinstance(ins, OptimizerStep))
        assert "OUTPUT_ALL_REDUCE ranks=[0, 1] [" in str(plan)
    program = cg.programs[0]   # it returns the partial loss: no conversion in its forward
    assert program.results == [program.loss] and "box" not in program.module.code


def test_only_the_ranks_of_the_stage_that_makes_it_sum_it():
    cg = compile_graph(DataParallel([0, 1, 2, 3], stages=2), inputs([0, 1], [2, 3]), 4)
    groups = {p.rank: [i.ranks for i in p.instructions if isinstance(i, OutputAllReduce)] for p in cg.plans}
    assert groups == {0: [], 1: [], 2: [(2, 3)], 3: [(2, 3)]}


def test_an_inference_plan_sums_after_its_last_forward():
    cg = compile_graph(DataParallel([0, 1], training=False), inputs([0, 1]), 2)
    for plan in cg.plans:
        assert isinstance(plan.instructions[-1], OutputAllReduce)
        assert sum(isinstance(i, COMPUTE) for i in plan.instructions) == M
