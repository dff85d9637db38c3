"""lower_plan for some ranks (NOTE: Plans of some ranks): a rank's plan lowered alone is the
plan the whole world's compile gives it, printed text for printed text."""
import os
import sys

import pytest

import graphc
from graphc import compiler
from graphc.executable import input_specs
from graphc.passes.lower_plan import lower_plan

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))
import plan_scale  # noqa: E402
from layouts import Pair, SquaredError, batches, feed  # noqa: E402
from plan.test_schedules import GRID, _chain  # noqa: E402


def _mlp(monkeypatch, pp, dp, tp, m, schedule="1f1b"):
    """(graph, example inputs, their layouts) of the plan_scale MLP on pp x dp x tp ranks."""
    world = pp * dp * tp
    for k, v in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", world)):
        monkeypatch.setenv(k, str(v))
    graph, inputs = plan_scale.mlp_graph(pp, dp, tp, m, schedule=schedule)
    specs = input_specs(inputs)
    return graph, [s.example() for s in specs], [s.layout for s in specs]


def assert_each_rank_alone_is_its_world_plan(graph, example, layouts, world):
    whole = compiler.compile(graph, example, world, layouts)
    assert whole.whole_world and len(whole.plans) == world
    for rank in range(world):
        alone = compiler.compile(graph, example, world, layouts, ranks=[rank])
        assert [p.rank for p in alone.plans] == [rank] and not alone.whole_world
        assert str(alone.plan_for(rank)) == str(whole.plan_for(rank)), f"rank {rank}"
        assert alone.key.digest == whole.key.digest   # the ranks agree on what they compiled


@pytest.mark.parametrize("pp,dp,tp", [(2, 2, 1), (1, 1, 2), (2, 2, 2)], ids=["pp2xdp2", "tp2", "pp2xdp2xtp2"])
def test_a_ranks_plan_alone_is_its_plan_in_the_world(monkeypatch, pp, dp, tp):
    graph, example, layouts = _mlp(monkeypatch, pp, dp, tp, 4)
    assert_each_rank_alone_is_its_world_plan(graph, example, layouts, pp * dp * tp)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_zero_ranks_plan_alone_is_its_plan_in_the_world(stage):
    graph = SquaredError(Pair(), "dp2")
    graph.config.enable_zero(True, stage=stage, shard_min_size=1)
    x, y = feed("dp2", batches(1))(0, 0)
    specs = input_specs((x, y))
    example, layouts = [s.example() for s in specs], [s.layout for s in specs]
    assert_each_rank_alone_is_its_world_plan(graph, example, layouts, 2)
    plan = compiler.compile(graph, example, 2, layouts, ranks=[1]).plan_for(1)
    assert "REDUCE_SCATTER" in str(plan) and "ALL_GATHER" in str(plan)


@pytest.mark.parametrize("schedule,p,v,m", GRID)
def test_sends_alone_follow_the_receivers_order(schedule, p, v, m):
    # several chunks a rank: a channel's sends are reordered to its receiver's receive order,
    # which a rank lowered alone takes from its receivers' lists
    progs, stages = _chain(schedule, p, v)
    whole = lower_plan(progs, stages, schedule, m, True, p)
    for rank in range(p):
        alone = lower_plan(progs, stages, schedule, m, True, p, ranks=[rank])
        assert [str(alone[0])] == [str(whole[rank])]


def test_plan_for_a_rank_not_lowered_is_an_error(monkeypatch):
    graph, example, layouts = _mlp(monkeypatch, 2, 1, 1, 2)
    alone = compiler.compile(graph, example, 2, layouts, ranks=[1])
    with pytest.raises(graphc.GraphcError, match="rank 0's plan was not compiled here"):
        alone.plan_for(0)
    assert alone.world_size == 2
