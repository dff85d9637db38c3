"""Model-state bytes per rank in one process (See NOTE: Model-state bytes in
graphc/tools/simulate/model_state.py; tests/zero/test_zero_model_state.py checks them against
real ranks): the optimizer's state count comes from a copy of it, Adam's 2 are assumed
without one and the table says so, and ZeRO's layouts give the bytes the NOTE states."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc.compiler import compile as compile_graph
from graphc.tools.cost_model import CostModel
from graphc.tools.simulate import model_inputs, simulate

ROWS, D_IN = 33, 64       # 33 rows on 2 ranks: shards of 17 and 16


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D_IN, ROWS, bias=False)

    def forward(self, x):
        return self.fc(x)


class Graph(graphc.Graph):
    def __init__(self, model, zero):
        super().__init__()
        self.model = model
        if zero:
            self.config.enable_zero(True, stage=zero, shard_min_size=1024)

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _simulated(zero, optimizer):
    where = graphc.placement("cpu", [0, 1])
    model = graphc.to_global(Net(), placement=where, sbp=graphc.sbp.broadcast)
    opt = optimizer(model.parameters()) if optimizer else None
    graph = Graph(model, zero)
    if opt is not None:
        graph.add_optimizer(opt)
    x, y = torch.randn(8, D_IN), torch.randint(0, ROWS, (8,))
    compiled = compile_graph(graph, [x, y], 2, [(where, (graphc.sbp.split(0),))] * 2)
    return simulate(compiled.plans, CostModel.uniform(1), model=model_inputs(compiled, opt))


@pytest.mark.parametrize("optimizer, states", [
    (lambda ps: torch.optim.Adam(ps), 2), (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), 0), (None, 2)])
def test_optimizer_states_counted_on_a_copy(optimizer, states):
    result = _simulated(0, optimizer)
    whole = ROWS * D_IN * 8
    assert [r.model_state.optimizer for r in result.ranks] == [states * whole] * 2
    assert ("assumed" in result.model_note) == (optimizer is None)
    assert "optim MiB" in result.table() and result.model_note in result.table()


def test_zero_layouts():
    row = D_IN * 8
    got = {zero: [(m.params, m.grads, m.optimizer) for m in
                   (r.model_state for r in _simulated(zero, lambda ps: torch.optim.Adam(ps)).ranks)]
           for zero in (0, 1, 2, 3)}
    whole = ROWS * row
    assert got[0] == [(whole, whole, 2 * whole)] * 2
    # rows 17 and 16; a reduce-scatter's part is padded to 17 rows, stage 1 keeps its 2 parts
    # (the shard's gradient a view of its own: no third)
    assert got[1] == [(whole, 2 * 17 * row, 2 * 17 * row), (whole, 2 * 17 * row, 2 * 16 * row)]
    assert got[2] == [(whole, 17 * row, 2 * 17 * row), (whole, 17 * row, 2 * 16 * row)]
    assert got[3] == [(17 * row, 17 * row, 2 * 17 * row), (16 * row, 17 * row, 2 * 16 * row)]
