"""config.set_cuda_graphs refused where a step cannot be captured (NOTE: CUDA graphs,
runtime/cuda_graphs.py), checked on the CPU: a GraphcError at the first call naming every
reason, never a step run differently. The captured run itself is tests/cuda/test_cuda.py
(bit for bit against the uncaptured one over 10 steps, on a GPU)."""
import pytest
import torch
import torch.nn as nn

import graphc
from graphc import sbp
from graphc.runtime.cuda_graphs import capture_blockers, compute_prefix
from helpers import compile_graph, global_input


class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.lin(x))


class Step(graphc.Graph):
    def __init__(self, model, optimizer=True, scaler=False, accumulation=1):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(accumulation)
        self.config.set_cuda_graphs(True)
        if scaler:
            self.set_grad_scaler(graphc.amp.GradScaler())
        if optimizer:
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, x):
        loss = self.model(x).square().mean()
        loss.backward()
        return loss


def test_refused_on_cpu_placements_at_the_first_call():
    graph = Step(nn.Linear(4, 4))
    with pytest.raises(graphc.GraphcError, match=r"Step: config.set_cuda_graphs\(True\) cannot capture"
                                                 r"(.|\n)*stage 0 runs on placement type \"cpu\"(.|\n)*Fix: place"):
        graph(torch.randn(2, 4))


def test_every_reason_is_named():
    """Data parallel with dropout (seeded per step and micro-batch, by the user's line), a
    GradScaler and no optimizer: each a line of its own."""
    graph = Step(Dropped(), optimizer=False, scaler=True)
    x = global_input(torch.randn(4, 4), graphc.placement("cpu", ranks=[0, 1]), sbp.split(0))
    compiled = compile_graph(graph, [x], 2)
    why = capture_blockers(compiled.plans, compiled.stages, compiled.programs, False, graph.grad_scaler)
    assert len(why) == 5, why
    assert "placement type \"cpu\"" in why[0] and "spans 2 ranks" in why[1]
    assert "test_cuda_graphs.py" in why[2] and "self.drop(self.lin(x))" in why[2] and "random" in why[2]
    assert "GradScaler" in why[3] and "without an optimizer" in why[4]


def test_dropout_on_one_rank_is_not_a_reason():
    """On one rank dropout draws from the device's generator as in eager (seed_random_ops
    leaves it), which a CUDA graph advances on every replay."""
    compiled = compile_graph(Step(Dropped()), [torch.randn(2, 4)], 1)
    why = capture_blockers(compiled.plans, compiled.stages, compiled.programs, True, None)
    assert len(why) == 1 and "placement type" in why[0], why


def test_what_is_captured_is_the_compute_before_the_optimizer_step():
    compiled = compile_graph(Step(nn.Linear(4, 4), accumulation=2), [torch.randn(4, 4)], 1)
    plan = compiled.plans[0]
    n = compute_prefix(plan)
    assert [str(i) for i in plan.instructions[:n]] == ["0F0", "0B0", "0F1", "0B1"]
    assert [type(i).__name__ for i in plan.instructions[n:]] == ["OptimizerStep"]


def test_set_cuda_graphs_checks_its_argument():
    graph = Step(nn.Linear(4, 4))
    with pytest.raises(graphc.GraphcError, match="set_cuda_graphs expects True or False"):
        graph.config.set_cuda_graphs("yes")
