"""The simulator under enable_amp: what crosses ranks costs half of float32's bytes (the
plans' TensorSpecs and collective bytes, tests/plan/test_precision_plans.py), and a device
preset charges autocast's bf16 matmuls at its low-precision FLOP rate, every float32 op at
its float32 rate (graphc/tools/flops.py)."""
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import compiler, sbp
from graphc.tools.cost_model import CostModel
from graphc.tools.costs import device_costs
from graphc.tools.flops import CountFlops
from graphc.tools.simulate import simulate

pytestmark = pytest.mark.fp32


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stage0 = nn.Sequential(nn.Linear(64, 128), nn.GELU())
        self.stage1 = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8))

    def forward(self, x):
        return self.stage1(self.stage0(x))


class Step(graphc.Graph):
    def __init__(self, layout: str, amp: bool):
        super().__init__()
        self.model = Net()
        if layout == "pipeline":
            self.model.stage0.config.set_stage(0, graphc.placement("cpu", [0]))
            self.model.stage1.config.set_stage(1, graphc.placement("cpu", [1]))
        else:   # Megatron's pair: stage1's first Linear split by rows, its second by columns
            p01 = graphc.placement("cpu", [0, 1])
            graphc.to_global(self.model, placement=p01, sbp=sbp.broadcast)
            graphc.to_global(self.model.stage1[0], placement=p01, sbp=sbp.split(0))
            graphc.to_global(self.model.stage1[2].weight, placement=p01, sbp=sbp.split(1))
        if amp:
            self.config.enable_amp(True, dtype=torch.bfloat16)
        self.config.set_gradient_accumulation_steps(4)
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _compiled(layout: str, amp: bool):
    g = torch.Generator().manual_seed(0)
    return compiler.compile(Step(layout, amp), [torch.randn(32, 64, generator=g),
                                                torch.randint(0, 8, (32,), generator=g)], 2)


@pytest.mark.parametrize("layout", ["pipeline", "tensor"])
def test_communication_time_halves(layout):
    """Free compute, links of 1 MB/s without latency: the step is its transfers (pipeline)
    or its collectives (tensor), all of them proportional to their bytes."""
    wire = dataclasses.replace(CostModel.uniform(2, 0.0, 0.0), bandwidth=1e6, latency=0.0)
    fp32, amp = (simulate(_compiled(layout, a).plans, wire).step_time for a in (False, True))
    assert fp32 > 0 and amp == pytest.approx(fp32 / 2, rel=1e-9)


def test_amp_runs_at_the_low_precision_rate():
    """Rates 1e6 bf16 and 1e3 fp32 FLOP/s make every stage compute-bound: under amp every
    counted FLOP is a bf16 matmul's (autocast casts the Linear layers), so the forward is
    1000 times faster; without it every FLOP is float32."""
    slow = dict(tflops=1e-6, fp32_tflops=1e-9, efficiency=1.0)
    fp32, amp = (device_costs(_compiled("pipeline", a), "h100", **slow) for a in (False, True))
    flops = 2 * 8 * 64 * 128                  # stage 0: its Linear on 8 rows, per micro-batch
    assert fp32.forward[0] == pytest.approx(flops / 1e3)
    assert amp.forward[0] == pytest.approx(flops / 1e6)
    assert amp.forward[1] == pytest.approx(fp32.forward[1] / 1000)
    assert "989 TFLOP/s bf16, 67.0 fp32" in device_costs(_compiled("pipeline", True), "h100").source


def test_flops_are_counted_by_the_dtype_of_their_operands():
    a, b = torch.randn(4, 8), torch.randn(8, 2)
    with CountFlops() as counter:
        a @ b
        a.bfloat16() @ b.bfloat16()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a @ b
    assert counter.flops.full == 2 * 4 * 8 * 2 and counter.flops.low == 2 * (2 * 4 * 8 * 2)
