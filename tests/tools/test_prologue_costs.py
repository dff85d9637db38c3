"""A data-parallel cross-entropy's Prologue (the whole batch's token count, all-reduced over
the data ranks) in the simulator's costs (NOTE: Prologue costs): its all-reduce found,
its module timed by the replay and priced by its ops on the cpu preset. No timing bound."""
import pytest
import torch
import torch.nn.functional as F

import graphc
from graphc.tools.costs import device_costs, measure_costs
from graphc.tools.network import DEVICES
from graphc.tools.prologue_costs import prologue_ops_and_bytes

P01 = graphc.placement("cpu", [0, 1])


class _Step(graphc.Graph):
    def __init__(self):
        super().__init__()
        self.model = graphc.to_global(torch.nn.Linear(8, 4), placement=P01, sbp=graphc.sbp.broadcast)
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


pytestmark = pytest.mark.slow     # a compile: 9 s at load 6 on the 2 cores


@pytest.fixture(scope="module")
def compiled():
    from graphc import compiler
    from graphc.executable import input_specs
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    split = [graphc.GlobalTensor(t.chunk(2)[0], P01, (graphc.sbp.split(0),), tuple(t.shape)) for t in (x, y)]
    specs = input_specs(split)
    graph = _Step()
    return compiler.compile(graph, [s.example() for s in specs], 2, [s.layout for s in specs]), graph


def test_the_token_count_is_all_reduced_over_the_data_ranks(compiled):
    compiled, _ = compiled
    prog = compiled.programs[0]
    assert prog.prologue is not None
    ops, nbytes = prologue_ops_and_bytes(prog, compiled)
    assert ops > 0 and len(nbytes) == len(prog.prologue.outputs) and all(n > 0 for n in nbytes)
    costs = device_costs(compiled, "cpu")
    pro = costs.prologue[0]
    assert pro.seconds == pytest.approx(ops * DEVICES["cpu"].op_us * 1e-6)
    assert [groups for groups, _ in pro.reduces] == [((0, 1),)]
    count = costs._scalar_sum((0, 1), nbytes[0])     # a collective's host time and its link's
    assert count >= costs.collective_overhead > 0
    assert costs.step_start(0, [0]) == pytest.approx(pro.seconds + count)
    assert device_costs(compiled, "h100").step_start(0, [0]) < costs.step_start(0, [0])


def test_the_replay_times_the_prologue(compiled):
    compiled, graph = compiled
    costs = measure_costs(compiled, graph._optimizer, repeats=1)
    assert costs.prologue[0].seconds > 0
    assert costs.prologue[0].reduces == device_costs(compiled, "cpu").prologue[0].reduces
