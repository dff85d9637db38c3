"""Schedules given as text (graphc/plan/schedule_text.py): per-rank compute orders, one line a
rank, as torchtitan reads a CSV; checked when read, lowered and verified like a built-in.
tests/local/test_schedule_registry.py trains one against eager."""
import pytest

from graphc.errors import GraphcError, PlanError
from graphc.passes.lower_plan import lower_plan
from graphc.plan.instructions import TensorSpec
from graphc.plan.plan import StageInfo
from graphc.plan.program import StageProgram
from graphc.plan.schedule_text import schedule_from_text, schedule_text
from graphc.plan.schedules import (SCHEDULES, check_schedule, compute_order, register_schedule,
                                   stage_count, unregister_schedule)
from graphc.plan.verify import verify_plans

SPEC = TensorSpec("h", (4, 8), "float32")
BUILT_IN = sorted(SCHEDULES)


def chain_plans(schedule, p, n, m):
    """A chain of n stages, one tensor sent down, laid out as `schedule` lays it out, lowered."""
    progs = [StageProgram(s, None, [], [], {}, {s - 1: [SPEC]} if s else {},
                          {s + 1: [SPEC]} if s < n - 1 else {}, {"h": True}) for s in range(n)]
    rank_of = {s: r for r, held in enumerate(SCHEDULES[schedule].family.layout(p, n)) for s in held}
    return lower_plan(progs, [StageInfo(s, (rank_of[s],)) for s in range(n)], schedule, m, True, p)


@pytest.fixture
def registered():
    names = []

    def register(name, text):
        register_schedule(schedule_from_text(name, text))
        names.append(name)
        return name
    yield register
    for name in names:
        unregister_schedule(name)


@pytest.mark.parametrize("schedule", BUILT_IN)
@pytest.mark.parametrize("p", [2, 4])
def test_every_built_in_schedule_reads_back_from_its_text(schedule, p, registered):
    n, m = stage_count(schedule, p), 2 * p
    text = schedule_text(schedule, p, n, m)
    copy = registered(f"text_{schedule}_{p}", text)
    assert SCHEDULES[copy].family is SCHEDULES[schedule].family
    for r in range(p):
        assert compute_order(copy, r, p, n, m) == compute_order(schedule, r, p, n, m)
    verify_plans(chain_plans(copy, p, n, m))


def test_a_hand_written_order_lowers_and_verifies(registered):
    name = registered("fill_drain_lifo", "0F0,0F1,0F2,0B2,0B1,0B0\n1F0,1F1,1F2,1B2,1B1,1B0\n")
    assert SCHEDULES[name].family.name == "one stage per rank"
    plans = chain_plans(name, 2, 2, 3)
    verify_plans(plans)
    assert "schedule=fill_drain_lifo" in str(plans[0]).splitlines()[0]


def test_an_order_that_deadlocks_is_refused_when_verified(registered):
    # rank 1 wants micro-batch 1's activation first; rank 0 sends it only after 0B0, which
    # waits for rank 1's 1B0, which comes after 1F1
    name = registered("crossed", "0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")
    with pytest.raises(PlanError, match=r"deadlock: these instructions wait on each other in a cycle"):
        verify_plans(chain_plans(name, 2, 2, 2))


@pytest.mark.parametrize("text, match", [
    ("0F0,0B0,0B0\n1F0,1B0", r"rank 0, action #2 `0B0`: stage 0 micro-batch 0 would run F then B then B"),
    ("0B0,0F0\n1F0,1B0", r"rank 0, action #0 `0B0`: stage 0 micro-batch 0 would run B"),
    ("0F0,0F1,0B0\n1F0,1B0,1F1,1B1", r"rank 0 leaves stage 0 micro-batch 1 after F"),
    ("0F0,0B0\n1F0,1B0,1F1,1B1", r"rank 0 never runs 0F1"),
    ("0F0,0B0,2F0,2B0\n1F0,1B0", r"no layout family places the stages so \(rank 0: stages \[0, 2\], "
                                 r"rank 1: stages \[1\]\)"),
    ("0F0,zz\n1F0", r"rank 0, action #1 'zz': not an instruction"),
    ("# nothing\n\n", r"names no compute"),
])
def test_a_wrong_text_is_refused_with_rank_and_action(text, match):
    with pytest.raises(GraphcError, match=match):
        schedule_from_text("mine", text)


def test_idle_cells_and_comments_are_skipped(registered):
    name = registered("with_gaps", "# rank 0, then rank 1\n0F0,,0B0\n,1F0,1B0\n")
    assert [str(i) for i in compute_order(name, 1, 2, 2, 1)] == ["1F0", "1B0"]


def test_it_runs_only_at_the_sizes_it_was_written_for(registered):
    name = registered("two_by_two", schedule_text("1f1b", 2, 2, 2))
    with pytest.raises(GraphcError, match=r"'two_by_two' with 2 pipeline ranks was written for 2 "
                       r"pipeline ranks and 2 micro-batches; found 4 micro-batches\. Fix: "
                       r"config\.set_gradient_accumulation_steps\(2\)"):
        check_schedule(name, 2, 2, 4)
    with pytest.raises(GraphcError, match=r"runs one stage per rank; found 4 stages"):
        check_schedule(name, 2, 4, 2)
