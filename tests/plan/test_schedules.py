"""Golden compute orders of the pipeline schedules."""
import pytest

from graphc.errors import GraphcError
from graphc.plan.schedules import compute_order


def order(schedule, stage, p, m):
    return " ".join(str(i)[len(str(stage)):] for i in compute_order(schedule, stage, p, p, m))


def test_1f1b_p4_m8_matches_the_canonical_order():
    assert order("1f1b", 0, 4, 8) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert order("1f1b", 1, 4, 8) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"
    assert order("1f1b", 2, 4, 8) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7"
    assert order("1f1b", 3, 4, 8) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"


def test_gpipe_p4_m8():
    for s in range(4):
        assert order("gpipe", s, 4, 8) == " ".join([f"F{i}" for i in range(8)] + [f"B{i}" for i in range(8)])


@pytest.mark.parametrize("m,stage0,stage1", [
    (1, "F0 B0", "F0 B0"),
    (2, "F0 F1 B0 B1", "F0 B0 F1 B1"),
    (3, "F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"),
])
def test_1f1b_p2_small_m(m, stage0, stage1):
    assert order("1f1b", 0, 2, m) == stage0
    assert order("1f1b", 1, 2, m) == stage1


@pytest.mark.parametrize("m", [1, 2, 3])
def test_gpipe_p2_small_m(m):
    expect = " ".join([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
    assert order("gpipe", 0, 2, m) == expect == order("gpipe", 1, 2, m)


@pytest.mark.parametrize("p,m", [(2, 1), (2, 3), (4, 8), (4, 2), (8, 3)])
def test_1f1b_holds_at_most_min_p_minus_s_m(p, m):
    for s in range(p):
        live = peak = 0
        for ins in compute_order("1f1b", s, p, p, m):
            live += 1 if str(ins)[len(str(s))] == "F" else -1
            peak = max(peak, live)
        assert peak == min(p - s, m)


def test_unknown_schedule_is_a_user_error():
    with pytest.raises(GraphcError, match="unknown pipeline schedule 'zb'"):
        compute_order("zb", 0, 2, 2, 2)
