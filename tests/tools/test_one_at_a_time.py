"""Waits of ranks that run one at a time, and what they and the Prologue cost the simulator
(NOTE: Shared cores, NOTE: Prologue costs). The model's arithmetic, never a measurement."""
from dataclasses import replace

import pytest

from graphc.plan.instructions import AllReduce, Forward, TensorSpec
from graphc.plan.plan import ExecutionPlan, StageInfo
from graphc.tools.cost_model import CostModel, PrologueCost
from graphc.tools.one_at_a_time import waits_one_at_a_time
from graphc.tools.shared_cores import rank_work, shared_core_floor
from graphc.tools.simulate import simulate

from test_simulate import chain_plans

COUNT = TensorSpec("count", (1,), "float64")


def _data_parallel(n: int, prologue: bool = False):
    """n ranks of one stage, each a forward and one all-reduce over all of them."""
    stages = (StageInfo(0, tuple(range(n))),)
    return [ExecutionPlan(r, n, [Forward(0, 0), AllReduce(tuple(range(n)), (COUNT,))], stages=stages)
            for r in range(n)]


def test_a_collective_waits_in_every_member_but_the_last():
    assert sum(waits_one_at_a_time(_data_parallel(3), CostModel.uniform(1)).values()) == 2
    assert sum(waits_one_at_a_time(_data_parallel(8), CostModel.uniform(1)).values()) == 7


def test_a_pipeline_rank_runs_ahead_until_it_needs_a_gradient():
    """2 stages: under GPipe rank 0 sends every forward before its first gradient comes back
    and rank 1 finds every activation there, so each waits once a step whatever the
    micro-batches; 1F1B's steady phase alternates a forward and a backward, and the ranks
    take turns every second micro-batch."""
    for m in (2, 4, 8):
        assert waits_one_at_a_time(chain_plans(2, m, "gpipe"), CostModel.uniform(2)) == {0: 1, 1: 1}
    assert waits_one_at_a_time(chain_plans(2, 8, "1f1b"), CostModel.uniform(2)) == {0: 4, 1: 4}


def test_each_wait_costs_a_handoff_where_ranks_share_a_core():
    plans = _data_parallel(4)
    costs = replace(CostModel.uniform(1), cores=1)
    assert shared_core_floor(plans, costs) == pytest.approx(4)          # 4 forwards of 1
    assert shared_core_floor(plans, replace(costs, handoff=0.5)) == pytest.approx(4 + 3 * 0.5)
    assert simulate(plans, replace(costs, handoff=0.5)).step_time == pytest.approx(5.5)


def test_the_prologue_is_charged_before_the_step():
    """A Prologue of 0.5 s and its all-reduce (0.25 s a member) on a rank's stage: its work
    and, where nothing hides it, its step grow by 0.75; with a wait before the first compute
    (a pipeline's last stage), the Prologue runs in it."""
    pro = PrologueCost(0.5, ((((0, 1), (2, 3)), 8),))
    costs = replace(CostModel.uniform(1), collective_overhead=0.25, prologue={0: pro})
    assert costs.step_start(2, [0]) == pytest.approx(0.75)
    assert costs.step_start(2, [1]) == 0.0
    plans = _data_parallel(4)
    assert rank_work(plans[0], costs) == pytest.approx(1 + 0.75 + 0.25)   # + the all-reduce
    assert simulate(plans, costs).step_time == pytest.approx(2.0)
    assert simulate(plans, costs, steps=3).step_time == pytest.approx(2.0)
    chain = chain_plans(2, 1)       # forward 1, backward 2 a stage: the step is 6
    late = replace(CostModel.uniform(2), prologue={1: PrologueCost(0.5)})
    assert simulate(chain, late).step_time == pytest.approx(6)
    early = replace(CostModel.uniform(2), prologue={0: PrologueCost(0.5)})
    assert simulate(chain, early).step_time == pytest.approx(6.5)


def test_a_prologue_all_reduce_is_a_wait_too():
    pro = PrologueCost(0.0, ((((0, 1),), 8),))
    plans = [ExecutionPlan(r, 2, [Forward(0, 0)], stages=(StageInfo(0, (0, 1)),)) for r in range(2)]
    with_prologue = waits_one_at_a_time(plans, replace(CostModel.uniform(1), prologue={0: pro}))
    assert sum(with_prologue.values()) == 1      # the first of the two to join the all-reduce
    assert waits_one_at_a_time(plans, CostModel.uniform(1)) == {0: 0, 1: 0}
