"""simulate(): bubble fractions, communication delays, live activations, deadlock."""
import pytest

from graphc import PlanError
from graphc.passes.lower_plan import lower_plan
from graphc.plan.instructions import Recv, TensorSpec
from graphc.plan.plan import StageInfo
from graphc.plan.program import StageProgram
from graphc.tools.costs import CostModel
from graphc.tools.simulate import simulate

SPEC = TensorSpec("h", (4, 1024), "float32")    # 16 KiB


def chain_plans(p, m, schedule="1f1b", training=True):
    """Plans of a p-stage chain (stage s on rank s) lowered exactly as the compiler does."""
    progs = [StageProgram(s, None, [], [], {}, {s - 1: [SPEC]} if s else {},
                          {s + 1: [SPEC]} if s < p - 1 else {}, {"h": True}) for s in range(p)]
    stages = [StageInfo(s, (s,)) for s in range(p)]
    return lower_plan(progs, stages, schedule, m, training, p)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_bubble_fraction_matches_formula(schedule, p, m):
    result = simulate(chain_plans(p, m, schedule), CostModel.uniform(p))
    expected = (p - 1) / (m + p - 1)
    assert abs(result.bubble_fraction - expected) <= 0.01 * max(expected, 1e-9) + 1e-12, \
        (result.bubble_fraction, expected)
    assert result.step_time == pytest.approx(3 * (m + p - 1))


@pytest.mark.parametrize("schedule,bound", [("gpipe", lambda p, s, m: m),
                                            ("1f1b", lambda p, s, m: min(p - s, m))])
def test_peak_live_microbatches(schedule, bound):
    p, m = 4, 8
    costs = CostModel.uniform(p)
    costs.activation_bytes = {s: 1000 for s in range(p)}
    for r in simulate(chain_plans(p, m, schedule), costs).ranks:
        assert r.peak_live_microbatches == bound(p, r.rank, m)
        assert r.peak_activation_bytes == 1000 * bound(p, r.rank, m)


def test_transfers_add_latency_and_wire_time():
    costs = CostModel.uniform(2)
    costs.latency, costs.bandwidth = 0.5, SPEC.nbytes / 0.25      # 0.75 per transfer
    result = simulate(chain_plans(2, 1), costs)
    # F0, transfer, F1, B1, transfer back, B0
    assert result.step_time == pytest.approx(1 + 0.75 + 1 + 2 + 0.75 + 2)


def test_unsatisfiable_recv_is_reported():
    plans = chain_plans(2, 2)
    plans[1].instructions.insert(0, Recv(1, 5, 0, "F", 0, (SPEC,)))
    with pytest.raises(PlanError, match="rank 1"):
        simulate(plans, CostModel.uniform(2))


def test_table_lists_every_rank():
    text = simulate(chain_plans(3, 4), CostModel.uniform(3)).table(unit="units", scale=1)
    assert [line.split()[0] for line in text.splitlines()[1:4]] == ["0", "1", "2"]
    assert "mean bubble 33.3%" in text
