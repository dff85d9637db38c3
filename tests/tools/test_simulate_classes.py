"""A world of plan templates simulated by its templates (NOTE: Simulated classes) equals the
simulation of every rank's plan, rank by rank and bit for bit; costs that differ by row
fall back to every rank."""
import dataclasses
import os
import sys

import pytest

from graphc import compiler
from graphc.executable import input_specs
from graphc.plan.templates import PlanWorld
from graphc.tools.cost_model import CostModel
from graphc.tools.network import Network
from graphc.tools.simulate import model_inputs, simulate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import plan_scale  # noqa: E402


@pytest.fixture(scope="module")
def compiled():
    """The MLP on pipeline 2 x data 4 x tensor 2 (16 ranks: 4 templates stand for 4 rows),
    compiled for the whole world once for the file."""
    pp, dp, tp, world = 2, 4, 2, 16
    with pytest.MonkeyPatch.context() as mp:
        for k, v in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", world)):
            mp.setenv(k, str(v))
        graph, inputs = plan_scale.mlp_graph(pp, dp, tp, 4)
        specs = input_specs(inputs)
        out = compiler.compile(graph, [s.example() for s in specs], world, [s.layout for s in specs])
    assert isinstance(out.plans, PlanWorld)
    return out


def _costs(compiled, ranks_per_node):
    """Unequal stages, priced transfers and collectives, nodes of `ranks_per_node` ranks."""
    n = len(compiled.stages)
    costs = CostModel({s: 1.0 + 0.25 * s for s in range(n)}, {s: 2.0 + 0.5 * s for s in range(n)},
                      optimizer={s: 0.3 for s in range(n)}, latency=0.01, bandwidth=1e5,
                      send_overhead=0.002, recv_overhead=0.001, sends_complete_on_delivery=True,
                      network=Network(ranks_per_node, 2e4, 0.05))
    costs.stage_of_rank = {r: s.stage_id for s in compiled.stages for r in s.ranks}
    return costs


def _same(classes, every):
    assert classes.step_time == every.step_time and classes.step_ends == every.step_ends
    assert [dataclasses.astuple(r) for r in classes.ranks] == [dataclasses.astuple(r) for r in every.ranks]
    for rank in every.timeline:
        assert classes.timeline[rank] == every.timeline[rank], f"rank {rank}"


def test_the_classes_simulate_every_rank(compiled):
    costs = _costs(compiled, ranks_per_node=8)          # each row's groups inside one node
    model = model_inputs(compiled)                     # model state and peak memory too
    classes = simulate(compiled.plans, costs, steps=3, model=model)
    every = simulate(list(compiled.plans), costs, steps=3, model=model)
    assert every.step_time > 0 and every.ranks[5].memory.peak > 0
    assert classes.classes is not None and len(classes.classes) == 4
    assert every.classes is None
    _same(classes, every)
    assert classes.table() == every.table()            # a small world: a row per rank
    folded = classes.table(every_rank=False).splitlines()
    assert "stands for" in folded[0] and len(folded) == len(every.table().splitlines()) - 16 + 4 + 1
    assert folded[2].split()[0] == "1" and folded[2].endswith("1, 3, ..., 7 (4 ranks)")


def test_costs_that_differ_by_row_simulate_every_rank(compiled):
    costs = _costs(compiled, ranks_per_node=3)          # row 1's tensor group {2, 3} crosses nodes
    result = simulate(compiled.plans, costs, steps=2)
    assert result.classes is None
    _same(result, simulate(list(compiled.plans), costs, steps=2))
