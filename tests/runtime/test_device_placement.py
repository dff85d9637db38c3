"""place_program (NOTE: CUDA placement, runtime/device.py): a stage program traced on CPU
stand-ins runs on its rank's device. Checked in one process by placing on the meta device,
which refuses a CPU operand like a GPU does (`Tensor on device cpu is not on the expected
device meta`), so no GPU is needed."""
import torch
import torch.nn as nn

import graphc
from graphc.runtime.device import place_program
from helpers import compile_graph


class Positions(nn.Module):
    """Reads its input's device three ways: a traced constant (arange), a device argument
    (zeros), and a non-persistent buffer (as a rotary embedding's inv_freq), which the state
    dict, and so GraphState.take_ownership, does not hold."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("shift", torch.full((4,), 0.5), persistent=False)

    def forward(self, x):
        pos = torch.arange(x.shape[1], dtype=x.dtype, device=x.device)
        zero = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        return self.lin(x + pos + self.shift) + zero


class Regression(graphc.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def build(self, x):
        return self.model(x).sum()


def test_program_traced_on_cpu_runs_on_the_rank_device():
    model = Positions()
    x = torch.randn(2, 4)
    compiled = compile_graph(Regression(model), [x], 1)
    module = compiled.programs[0].module
    assert "device(type='cpu')" in module.code or any(
        t.device.type == "cpu" for t in module.buffers())  # what the trace left for the CPU
    place_program(module, torch.device("meta"))
    model.lin.to("meta")   # the parameters: GraphState.take_ownership's move of the state dict
    assert "device(type='cpu')" not in module.code
    assert all(t.device.type == "meta" for t in module.buffers())
    (out,) = module(x.to("meta"))
    assert out.device.type == "meta" and out.shape == ()


def test_placing_twice_changes_nothing_more():
    compiled = compile_graph(Regression(Positions()), [torch.randn(2, 4)], 1)
    module = compiled.programs[0].module
    place_program(module, torch.device("meta"))
    code = module.code
    place_program(module, torch.device("meta"))
    assert module.code == code
