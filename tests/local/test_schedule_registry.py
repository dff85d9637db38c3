"""A schedule added in one place is checked everywhere (See NOTE: Schedule registry).

A toy schedule, registered here and nowhere else (no other test names it), is verified as
a program and as lowered plans, swept in a local world against eager (float64, 1e-10),
charted (its simulated schedule drawn, and its row of the bubble table) and tabled in the
docs' table. It has no torch equivalent, so
the torch comparisons leave it out rather than fail.
"""
import os
import sys

import pytest

import sweep
from graphc.plan.instructions import Backward, Forward
from graphc.plan.schedule_text import schedule_from_text
from graphc.plan.schedules import (ONE_STAGE_LAYOUT, SCHEDULES, Schedule, register_schedule,
                                   unregister_schedule)
from graphc.tools import bubbles, schedule_table
from graphc.tools.chart import draw_timeline
from graphc.tools.cost_model import CostModel
from graphc.tools.simulate import simulate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "plan"))
import test_schedules  # noqa: E402  (the checks every registered schedule gets)

TOY = "toy_last_in_first_out"


def last_in_first_out(rank, num_ranks, num_stages, num_microbatches):
    """All forwards, then the backwards newest first (GPipe with its drain reversed)."""
    m = num_microbatches
    return [Forward(rank, i) for i in range(m)] + [Backward(rank, i) for i in reversed(range(m))]


@pytest.fixture
def toy():
    register_schedule(Schedule(TOY, last_in_first_out, ONE_STAGE_LAYOUT, needs="n = p", peak="m"))
    yield TOY
    unregister_schedule(TOY)
    assert TOY not in SCHEDULES


def test_a_registered_schedule_is_verified_tabled_and_charted(toy):
    test_schedules.check_every_rank_runs_a_valid_program(toy)
    test_schedules.check_inference_runs_the_schedules_layout(toy)
    grid = list(test_schedules._grid([toy]))
    assert len(grid) == 6                                     # p 2 and 4, m p, 2p and 4p
    for _, p, v, m in grid:
        test_schedules.verify_plans(test_schedules.chain_plans(toy, p, v, m))
    assert toy not in test_schedules.WITH_TORCH               # no torch class: not compared

    assert f"| `{toy}` | (none) | stage r | B | n = p | m | 16, 16, 16, 16 |" in schedule_table.table()

    rows = [b for b in bubbles.table(4, 2, (8,)) if b.schedule == toy]
    gpipe = bubbles.bubble("gpipe", 4, 1, 8)
    assert len(rows) == 1 and rows[0].over_ideal == pytest.approx(gpipe.over_ideal)   # same bubble
    assert f"| {toy} | 0.375 | 0.375 | 0.187 |  |" in bubbles.markdown()            # the docs' bubbles


def test_a_registered_schedule_is_charted(toy, tmp_path):
    """Its plans simulated at unit costs and drawn as graphc plan's schedule chart is: a box per
    compute, the toy's backwards newest first on every rank."""
    pytest.importorskip("matplotlib")
    plans, n = bubbles.chain_plans(toy, 2, 1, 4)
    result = simulate(plans, CostModel.uniform(n))
    backwards = [[s.label for s in spans if s.kind == "backward"] for spans in result.timeline.values()]
    assert backwards == [[f"{r}B{i}" for i in (3, 2, 1, 0)] for r in range(2)]
    paths = draw_timeline(result.timeline, str(tmp_path / "schedule"), f"{toy}: 2 ranks, 4 micro-batches")
    assert paths and all(os.path.getsize(p) > 1000 for p in paths)


def test_a_registered_schedule_is_swept_and_trains_like_eager(toy):
    swept = [c for c in sweep.configurations() if c.schedule == toy]
    assert {c.pp for c in swept} == {2, 4, 8} and len(swept) >= 20
    ok, text = sweep.check(sweep.Config("skip", pp=2, dp=1, tp=1, schedule=toy, acc=2))
    assert ok, text
    assert "OK: 2 step(s)" in text


# a V of 4 stages on 2 ranks, written by hand: each rank runs its first chunk's forwards,
# then the other chunk's, then the backwards newest first (ZB-V's layout, no split backward)
V_BY_HAND = """
# rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
0F0,0F1,3F0,3F1,3B1,3B0,0B1,0B0
1F0,1F1,2F0,2F1,2B1,2B0,1B1,1B0
"""


def test_a_schedule_given_as_text_trains_like_eager():
    register_schedule(schedule_from_text("v_by_hand", V_BY_HAND))
    try:
        assert SCHEDULES["v_by_hand"].family.name == "V"
        ok, text = sweep.check(sweep.Config("skip", pp=2, dp=1, tp=1, schedule="v_by_hand", acc=2))
        assert ok, text
        assert "OK: 2 step(s)" in text
    finally:
        unregister_schedule("v_by_hand")
