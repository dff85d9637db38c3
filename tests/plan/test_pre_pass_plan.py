"""The whole-batch sums' pre-pass as plan instructions (See NOTE: Whole-batch sums): lowered
before every schedule's first instruction, printed and parsed back, its transfers paired and
its order checked by the verifier, priced by the simulator as a forward. Hand-made stage
programs, no model: lower_plan reads only their interfaces and Prologues."""
import pytest

from graphc.errors import PlanError
from graphc.passes.lower_plan import lower_plan
from graphc.plan.instructions import PRE, Forward, PrePass, Recv, Send, TensorSpec
from graphc.plan.plan import ExecutionPlan, StageInfo
from graphc.plan.program import Prologue, StageProgram
from graphc.plan.verify import verify_plans
from graphc.tools.cost_model import CostModel
from graphc.tools.simulate import simulate

H = TensorSpec("h", (4, 8), "float64")      # each stage's output, the next stage's input
LOGITS = TensorSpec("logits", (4, 2), "float32")   # an earlier router's, read by the last stage


def chain(n: int, stage_ranks, schedule: str, m: int = 4):
    """n stages in a chain, every stage's pre-pass sending the next what its cut reads (h), the
    last stage reading stage 0's logits too (a skip), lowered for `schedule`."""
    progs = []
    for s in range(n):
        recv = {s - 1: [H]} if s else {}
        send = {s + 1: [H]} if s < n - 1 else {}
        if s == 0 and n > 1:
            send.setdefault(n - 1, []).append(LOGITS)
        if s == n - 1 and n > 1:
            recv.setdefault(0, []).append(LOGITS)
        pro = Prologue(None, [], ["graphc_whole_histc"] if s == n - 1 else [], [()] if s == n - 1 else [],
                       in_plan=True, sent=[t.name for v in send.values() for t in v], recv_from=recv,
                       send_to=send)
        progs.append(StageProgram(s, None, [], [], {}, recv, send, {"h": True}, prologue=pro))
    stages = [StageInfo(s, tuple(r)) for s, r in enumerate(stage_ranks)]
    return lower_plan(progs, stages, schedule, m, True, max(r for rs in stage_ranks for r in rs) + 1)


LAYOUTS = {"1f1b": [(0,), (1,)], "interleaved_1f1b": [(0,), (1,), (0,), (1,)], "zbv": [(0,), (1,), (1,), (0,)],
           "dualpipev": [(0,), (1,), (1,), (0,)]}


@pytest.mark.parametrize("schedule", list(LAYOUTS))
def test_the_pre_pass_runs_before_the_schedule_and_verifies(schedule):
    plans = chain(len(LAYOUTS[schedule]), LAYOUTS[schedule], schedule)
    verify_plans(plans)
    for plan in plans:
        first_forward = next(i for i, ins in enumerate(plan.instructions) if isinstance(ins, Forward))
        pre = [i for i, ins in enumerate(plan.instructions) if isinstance(ins, PrePass)]
        assert pre and max(pre) < first_forward, str(plan)
        assert [ins for ins in plan.instructions if isinstance(ins, PrePass)] == \
            sorted((ins for ins in plan.instructions if isinstance(ins, PrePass)),
                   key=lambda i: (i.stage, i.microbatch))   # stages in order, micro-batches in order
        assert ExecutionPlan.parse(str(plan)) == plan
        assert ExecutionPlan.from_json(plan.to_json()) == plan
    moved = [ins for plan in plans for ins in plan.instructions if isinstance(ins, (Send, Recv)) and ins.direction == PRE]
    assert moved, "the pre-pass's values cross ranks"
    if schedule in ("zbv", "dualpipev"):   # stages 1 and 2 on rank 1: h handed over in memory, never sent
        assert not any(ins.stage == 1 and ins.peer_stage == 2 for ins in moved)


def test_a_pre_pass_send_without_its_receive_is_refused():
    plans = chain(2, LAYOUTS["1f1b"], "1f1b")
    recv = next(ins for ins in plans[1].instructions if isinstance(ins, Recv) and ins.direction == PRE)
    plans[1].instructions.remove(recv)
    with pytest.raises(PlanError, match=r"0SEND_P0|1RECV_P"):
        verify_plans(plans)


def test_a_pre_pass_after_its_stages_forward_is_refused():
    plans = chain(2, LAYOUTS["1f1b"], "1f1b")
    ins = plans[0].instructions
    ins.append(ins.pop(ins.index(PrePass(0, 3))))
    with pytest.raises(PlanError, match=r"`0P3` comes after a forward of stage 0"):
        verify_plans(plans)


def test_the_simulator_prices_a_pre_pass_as_a_forward():
    """Four micro-batches of two stages, forward 1 s, backward 2 s: each stage runs four
    pre-pass forwards; stage 1's run (each 1 s behind stage 0's, waiting for h) while stage 0
    starts its schedule, so the step is four forwards longer."""
    costs = CostModel.uniform(2)
    plain = chain(2, LAYOUTS["1f1b"], "1f1b")
    for plan in plain:
        plan.instructions[:] = [i for i in plan.instructions
                                if not isinstance(i, PrePass) and getattr(i, "direction", "") != PRE]
    without, with_pre = simulate(plain, costs).step_time, simulate(chain(2, LAYOUTS["1f1b"], "1f1b"), costs).step_time
    assert with_pre == pytest.approx(without + 4.0), (without, with_pre)
