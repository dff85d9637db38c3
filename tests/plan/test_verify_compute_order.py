"""verify_plans check 4: each rank runs F, then B or I then W, once per (stage, micro-batch)."""
import pytest

from graphc.errors import PlanError
from graphc.passes.lower_plan import lower_plan
from graphc.plan.instructions import (Backward, BackwardInput, BackwardWeight, Forward,
                                      TensorSpec)
from graphc.plan.plan import StageInfo
from graphc.plan.program import StageProgram
from graphc.plan.verify import verify_plans

SPEC = TensorSpec("h", (4, 8), "float32")


def two_stage_plans(schedule, m=4):
    """Plans of a two-stage chain on two ranks, as the compiler lowers them."""
    progs = [StageProgram(0, None, [], [], {}, {}, {1: [SPEC]}, {"h": True}),
             StageProgram(1, None, [], [], {}, {0: [SPEC]}, {}, {"h": True})]
    return lower_plan(progs, [StageInfo(0, (0,)), StageInfo(1, (1,))], schedule, m, True, 2)


def _at(plan, ins):
    return plan.instructions.index(ins)


def test_split_backward_plans_verify():
    verify_plans(two_stage_plans("zero_bubble"))


def test_weight_before_its_input_gradient_is_caught():
    plans = two_stage_plans("zero_bubble")
    ins = plans[1].instructions
    i, w = _at(plans[1], BackwardInput(1, 2)), _at(plans[1], BackwardWeight(1, 2))
    ins[i], ins[w] = ins[w], ins[i]
    with pytest.raises(PlanError, match=rf"rank 1, instruction #{i} `1W2`: .*after F\) comes "
                       r"before its I.*'zero_bubble' \(graphc/plan/schedules.py\)") as e:
        verify_plans(plans)
    assert "<-- ERROR HERE" in str(e.value)


def test_missing_weight_is_caught():
    plans = two_stage_plans("zero_bubble")
    plans[0].instructions.remove(BackwardWeight(0, 3))
    with pytest.raises(PlanError, match=r"rank 0, instruction #\d+ `0I3`: stage 0 micro-batch 3 "
                       r"ran F\+I and never its W"):
        verify_plans(plans)


def test_second_forward_is_caught():
    plans = two_stage_plans("1f1b")
    ins = plans[0].instructions
    ins.insert(len(ins) - 1, Forward(0, 1))
    with pytest.raises(PlanError, match=r"rank 0, .*`0F1` .* runs a second time"):
        verify_plans(plans)


def test_backward_before_its_forward_is_caught():
    plans = two_stage_plans("gpipe", m=2)
    ins = plans[1].instructions
    f, b = _at(plans[1], Forward(1, 0)), _at(plans[1], Backward(1, 0))
    ins[f], ins[b] = ins[b], ins[f]
    with pytest.raises(PlanError, match=r"`1B0` .*comes before its forward"):
        verify_plans(plans)


def test_whole_and_split_backward_mixed_is_caught():
    plans = two_stage_plans("zero_bubble")
    w = _at(plans[0], BackwardWeight(0, 0))
    plans[0].instructions[w] = Backward(0, 0)
    with pytest.raises(PlanError, match=rf"rank 0, instruction #{w} `0B0`.*after F\+I\) mixes a "
                       r"whole backward \(B\) with a split one"):
        verify_plans(plans)
