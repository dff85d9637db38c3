"""Stage programs call graphc functions from graphc/ops/ only (and the local op forms of
graphc/sbp/local_ops.py, which move there later): the plan IR holds none of them. Checked on
a compiled program that uses every kind: an SBP conversion, a seeded dropout, a loss over
the whole batch and an autocast region (NOTE: Stage-program names, graphc/ops/__init__.py)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from helpers import compile_graph

P01 = graphc.placement("cpu", [0, 1])


class Everything(graphc.Graph):
    def __init__(self):
        super().__init__()
        model = graphc.to_global(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)), placement=P01,
                                 sbp=sbp.broadcast)
        graphc.to_global(model[0], placement=P01, sbp=sbp.split(0))
        graphc.to_global(model[1].weight, placement=P01, sbp=sbp.split(1))
        self.model = model
        self.config.set_gradient_accumulation_steps(2)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = F.dropout(torch.relu(self.model[0](x)), 0.1)
        loss = F.cross_entropy(self.model[1](h.float()), y, ignore_index=0)
        loss.backward()
        return loss


def graphc_targets(cg):
    """{module of each graphc function a stage program calls}."""
    found = set()
    for prog in cg.programs:
        modules = [prog.module] + ([prog.prologue.module] if prog.prologue is not None else [])
        for node in (n for m in modules for n in m.graph.nodes):
            module = getattr(node.target, "__module__", None) or ""
            if node.op == "call_function" and module.startswith("graphc"):
                found.add(module)
    return found


@pytest.mark.fp32
def test_stage_programs_call_graphc_ops_only():
    cg = compile_graph(Everything(), [torch.randn(8, 8), torch.randint(0, 4, (8,))], 2)
    found = graphc_targets(cg)
    assert {"graphc.ops.conversions", "graphc.ops.random_ops", "graphc.ops.loss",
            "graphc.ops.autocast"} <= found, found
    assert not [m for m in found if m.startswith("graphc.plan")], found
    assert found <= {"graphc.ops.conversions", "graphc.ops.random_ops", "graphc.ops.loss",
                     "graphc.ops.autocast", "graphc.sbp.local_ops"}, found
    code = "\n".join(p.code for p in cg.programs)
    for name in ("graphc_ops_conversions_box(", "graphc_ops_random_ops_seeded(",
                 "graphc_ops_autocast_set_autocast(", "graphc_ops_loss_cross_entropy_over_batch("):
        assert name in code, name
