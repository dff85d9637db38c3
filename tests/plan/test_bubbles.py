"""Simulated bubbles of the schedules on equal stages (graphc/tools/bubbles.py), against the
values the papers derive: 1F1B and GPipe (p - 1) / m of the ideal step, interleaved
(p - 1) / (v m) (Narayanan et al. 2021), ZB-H1 (zero_bubble, one chunk) (F + I - W) / (F + I + W)
of 1F1B's bubble (Qi et al. 2023: a third at F = I = W, a half at F = B with I = W)."""
import pytest

from graphc.plan.schedules import SCHEDULES
from graphc.tools.bubbles import bubble, render, table

WITH_TEXTBOOK = sorted(name for name, s in SCHEDULES.items() if s.textbook)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 2, 16), (2, 4, 8)])
@pytest.mark.parametrize("schedule", WITH_TEXTBOOK)
def test_simulated_bubble_is_the_textbooks(schedule, p, v, m):
    """1F1B and GPipe (p - 1) / m, interleaved (p - 1) / (v m): the record's `textbook`."""
    b = bubble(schedule, p, v, m)
    assert b.over_ideal == pytest.approx(SCHEDULES[schedule].textbook(p, b.chunks, m))


def test_textbook_formulas_are_the_papers():
    assert set(WITH_TEXTBOOK) >= {"gpipe", "1f1b", "interleaved_1f1b"}
    assert SCHEDULES["1f1b"].textbook(4, 1, 8) == SCHEDULES["gpipe"].textbook(4, 1, 8) == 3 / 8
    assert SCHEDULES["interleaved_1f1b"].textbook(4, 2, 8) == 3 / 16


@pytest.mark.parametrize("backward,share", [(2.0, 1 / 3), (1.0, 1 / 2)])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_zero_bubble_h1_shrinks_1f1b_bubble_as_the_paper_derives(p, m, backward, share):
    zb = bubble("zero_bubble", p, 1, m, backward).over_ideal
    assert zb == pytest.approx(share * bubble("1f1b", p, 1, m, backward).over_ideal)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_v_schedules_beat_interleaving_at_equal_chunks(p, m):
    one = bubble("1f1b", p, 1, m, 2.0).over_ideal
    zbv = bubble("zbv", p, 2, m, 2.0).over_ideal
    assert zbv <= one / 6 + 1e-12
    assert zbv < bubble("interleaved_1f1b", p, 2, m, 2.0).over_ideal


def test_table_lists_every_schedule_once_per_microbatch_count():
    rows = table(4, 2, (8, 16))
    assert sorted((r.schedule, r.microbatches) for r in rows) == sorted(
        (name, m) for name in SCHEDULES for m in (8, 16))
    text = render(rows)
    assert "interleaved_1f1b    4  2   8        1.188          0.188     0.188" in text


def test_docs_bubble_table_is_the_simulators():
    """docs/schedules.md's bubble table is what `python -m graphc.tools.bubbles --markdown`
    prints for the registered schedules (a new schedule shows there, or this fails)."""
    from pathlib import Path
    from graphc.tools.bubbles import markdown
    doc = (Path(__file__).parents[2] / "docs" / "schedules.md").read_text()
    assert markdown() in doc, "docs/schedules.md: paste python -m graphc.tools.bubbles --markdown"
