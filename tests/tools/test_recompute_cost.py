"""The simulator charges a checkpointed micro-batch's recomputed forward once, in the
backward (or backward-input half) that runs it (NOTE: Recompute cost in tools/cost_model.py).

Every check is exact: a rank's busy time (the sum of its compute spans) with checkpointing
minus without is the recomputed micro-batches times the stage's forward cost, on a device
preset's modelled costs and on costs measured here; where one rank computes alone the step
grows by that much too."""
import functools

import pytest
import torch

from graphc import compiler
from graphc.plan.instructions import Backward, Forward, OverlapFB
from graphc.runtime.executor import StageExecutor
from graphc.tools.cost_model import CostModel
from graphc.tools.costs import device_costs, measure_costs
from graphc.tools.simulate import simulate
from models import PipelineGraph, SkipNet
from test_simulate import chain_plans

M = 4


@functools.lru_cache(maxsize=None)
def _compiled(checkpointing: str, schedule: str = "zero_bubble", stages: int = 2):
    torch.manual_seed(0)
    graph = PipelineGraph(SkipNet(stages), None, accumulation=M, schedule=schedule)
    graph.add_optimizer(torch.optim.SGD(graph.model.parameters(), lr=0.1))
    graph.config.set_activation_checkpointing(checkpointing)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(16, 16, generator=g), torch.randint(0, 5, (16,), generator=g)]
    return compiler.compile(graph, inputs, stages)


def _busy(plans, costs):
    return {r.rank: r.busy for r in simulate(plans, costs).ranks}


def _recomputed_forward(plans, costs, recomputed: int):
    """rank -> the seconds of its stages' forwards over `recomputed` micro-batches."""
    return {p.rank: recomputed * sum(costs.forward[s] for s in p.local_stages) for p in plans}


@pytest.mark.parametrize("mode,recomputed", [("always", M), ("except_last", M - 1), ("never", 0)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
def test_each_recomputed_microbatch_costs_its_forward_once(schedule, mode, recomputed):
    costs = CostModel({0: 1.0, 1: 1.5}, {0: 2.0, 1: 3.0})
    plain = _busy(chain_plans(2, M, schedule), costs)
    ckpt = chain_plans(2, M, schedule, checkpointing=mode)
    extra = _recomputed_forward(ckpt, costs, recomputed)
    assert {r: b - plain[r] for r, b in _busy(ckpt, costs).items()} == pytest.approx(extra, abs=1e-12)


def test_one_rank_step_grows_by_the_recomputed_forwards():
    costs = CostModel.uniform(1)
    plain = simulate(chain_plans(1, M), costs).step_time
    assert simulate(chain_plans(1, M, checkpointing="always"), costs).step_time == pytest.approx(plain + M * 1.0)


def test_dualpipev_pair_charges_its_backwards_recompute():
    costs = CostModel({0: 1.0, 3: 1.5}, {0: 2.0, 3: 3.0})
    pair = OverlapFB(Forward(0, 2), Backward(3, 1))
    assert costs.compute(pair, 0) == 1.0 + 3.0
    assert costs.compute(pair, 0, frozenset({1})) == 1.0 + 3.0 + 1.5    # stage 3's forward again
    assert costs.compute(pair, 0, frozenset({2})) == 1.0 + 3.0          # the forward's: not recomputed


def test_device_preset_charges_the_recompute_in_backward_input():
    """On h100's modelled costs, a zero-bubble schedule (split backward): the recompute is
    charged in each checkpointed micro-batch's backward-input half, once."""
    plain, ckpt = _compiled("never"), _compiled("always")
    costs = device_costs(ckpt, "h100")
    assert costs.forward == device_costs(plain, "h100").forward   # the same programs' FLOPs
    got = {r: b - p for (r, b), p in zip(_busy(ckpt.plans, costs).items(), _busy(plain.plans, costs).values())}
    assert got == pytest.approx(_recomputed_forward(ckpt.plans, costs, M), rel=1e-12)
    assert all(v > 0 for v in got.values())


def test_measured_backward_holds_no_recompute(monkeypatch):
    """measure_costs replays a checkpointed stage without recomputing (its backward is a
    plain one), so the simulator's charge is the only one."""
    calls = []
    original = StageExecutor._recompute
    monkeypatch.setattr(StageExecutor, "_recompute",
                        lambda self, mb, saved: calls.append(mb) or original(self, mb, saved))
    ckpt = _compiled("always")
    costs = measure_costs(ckpt, repeats=1)
    assert calls == []
    plain = _compiled("never")
    got = {r: b - p for (r, b), p in zip(_busy(ckpt.plans, costs).items(), _busy(plain.plans, costs).values())}
    assert got == pytest.approx(_recomputed_forward(ckpt.plans, costs, M), rel=1e-9)
