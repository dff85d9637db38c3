"""Collectives issued after compute pay their members' drift (NOTE: Collectives in context):
what the simulator charges for a given plan and skew curve. The model's arithmetic, never a
measurement."""
from dataclasses import replace

import pytest

from graphc.plan.instructions import AllReduce, Forward, TensorSpec
from graphc.plan.plan import ExecutionPlan, StageInfo
from graphc.tools.cost_model import CostModel, PrologueCost
from graphc.tools.simulate import simulate

GRAD = TensorSpec("g", (4,), "float32")
SKEW = [(1.0, 0.25), (3.0, 0.45)]     # (compute since the last collective, extra seconds)


def _tensor_parallel(forwards_before: int, collectives: int = 1, n: int = 2):
    """n ranks of one stage: `collectives` times, forwards then an all-reduce over all."""
    stages = (StageInfo(0, tuple(range(n))),)
    body = [Forward(0, 0)] * forwards_before + [AllReduce(tuple(range(n)), (GRAD,))]
    return [ExecutionPlan(r, n, body * collectives, stages=stages) for r in range(n)]


def test_skew_is_interpolated_and_proportional_beyond_the_last_point():
    costs = replace(CostModel.uniform(1), collective_skew=SKEW)
    assert costs.skew(0.0) == 0.0
    assert costs.skew(0.5) == pytest.approx(0.125)          # from (0, 0) to the first point
    assert costs.skew(2.0) == pytest.approx(0.35)
    assert costs.skew(6.0) == pytest.approx(0.9)            # 0.45 / 3 per second beyond
    assert CostModel.uniform(1).skew(5.0) == 0.0            # nothing measured: nothing charged


def test_a_collective_pays_the_drift_of_the_compute_since_the_last_one():
    """Forwards of 1 s, a free all-reduce: each collective adds skew(compute since the
    previous collective), whatever the step count; without a curve the step is unchanged."""
    base = CostModel.uniform(1)
    costs = replace(base, collective_skew=SKEW)
    assert simulate(_tensor_parallel(1), base).step_time == pytest.approx(1.0)
    assert simulate(_tensor_parallel(1), costs).step_time == pytest.approx(1.25)
    assert simulate(_tensor_parallel(3), costs).step_time == pytest.approx(3.45)
    assert simulate(_tensor_parallel(1, collectives=2), costs, steps=4).step_time == pytest.approx(2.5)
    # back to back: the second of two collectives follows no compute and pays nothing
    plans = _tensor_parallel(1)
    for p in plans:
        p.instructions.append(AllReduce((0, 1), (GRAD,)))
    assert simulate(plans, costs, steps=3).step_time == pytest.approx(1.25)


def test_the_drift_of_the_most_computing_member_is_charged():
    """Rank 1 computes twice as long before the collective: it arrives last, and the
    collective ends skew(its 2 s) after it."""
    plans = _tensor_parallel(1)
    plans[1].instructions.insert(0, Forward(0, 0))
    costs = replace(CostModel.uniform(1), collective_skew=SKEW)
    assert simulate(plans, costs).step_time == pytest.approx(2 + 0.35)


def test_symmetric_ranks_folded_pay_the_same_drift():
    """8 ranks fold into one class (NOTE: Symmetric ranks): the step is as unfolded."""
    costs = replace(CostModel.uniform(1), collective_skew=SKEW)
    assert simulate(_tensor_parallel(1, n=8), costs, steps=3).step_time == pytest.approx(1.25)


def test_the_first_prologue_all_reduce_pays_the_drift_since_the_last_collective():
    """A Prologue of 0.5 s with two all-reduces (free) before a plan of a forward (1 s) and
    an all-reduce: per step the plan's collective pays skew(1) and the Prologue's first
    skew(0.5 + 0 s since the plan's collective): 1.5 + 0.25 + 0.125."""
    pro = PrologueCost(0.5, ((((0, 1),), 8), (((0, 1),), 8)))
    costs = replace(CostModel.uniform(1), collective_skew=SKEW, prologue={0: pro})
    assert costs.step_start_syncs(0, [0]) == 2
    assert simulate(_tensor_parallel(1), costs, steps=4).step_time == pytest.approx(1.5 + 0.25 + 0.125)


def test_the_measured_curve_is_made_non_decreasing():
    """A smaller extra after a longer gap is noise: pooled with its neighbour, in place."""
    from graphc.tools.transport_costs import monotone
    assert monotone([(1, 0.5), (2, 5.8), (8, 3.0), (32, 7.0)]) == [(1, 0.5), (2, 4.4), (8, 4.4), (32, 7.0)]
    assert monotone([(1, 0.1), (2, 0.2)]) == [(1, 0.1), (2, 0.2)]
    assert monotone([(1, 3.0), (2, 2.0), (3, 1.0)]) == [(1, 2.0), (2, 2.0), (3, 2.0)]
