"""The CPU cost model: shared cores (NOTE: Shared cores), the cpu preset's host costs, the
search's estimate under them, and measure_costs' concurrent replay (NOTE: Concurrent replay).
Times here are the model's arithmetic, never a measurement compared with a bound."""
from dataclasses import replace

import pytest
import torch

from graphc.plan.instructions import AllReduce, TensorSpec
from graphc.tools.cost_model import CostModel
from graphc.tools.network import DEVICES, Network
from graphc.tools.shared_cores import rank_work, shared_core_floor
from graphc.tools.simulate import simulate

from test_simulate import SPEC, chain_plans


def test_a_pipeline_on_one_core_takes_its_summed_work():
    """4 stages of forward 1, backward 2 and 4 micro-batches: 12 units a rank, 48 in all;
    with their own cores the step is the 1F1B makespan 3 (m + p - 1) = 21."""
    plans = chain_plans(4, 4)
    alone = simulate(plans, CostModel.uniform(4))
    shared = simulate(plans, replace(CostModel.uniform(4), cores=1))
    assert alone.step_time == pytest.approx(21)
    assert [rank_work(p, CostModel.uniform(4)) for p in plans] == [12, 12, 12, 12]
    assert shared.step_time == pytest.approx(48)
    assert simulate(plans, replace(CostModel.uniform(4), cores=2)).step_time == pytest.approx(24)
    assert simulate(plans, replace(CostModel.uniform(4), cores=4)).step_time == pytest.approx(21)


def test_the_floor_counts_each_node_apart():
    """Two nodes of 2 ranks: the busiest node's work over its cores."""
    plans = chain_plans(4, 1)
    costs = replace(CostModel.uniform(4), cores=1, network=Network(2, 1e12, 0.0))
    assert shared_core_floor(plans, costs) == pytest.approx(6)     # ranks 0 and 1: 3 + 3
    assert shared_core_floor(plans, CostModel.uniform(4)) == 0.0   # no cores: no bound


def test_transfers_and_collectives_are_work():
    plans = chain_plans(2, 1)
    costs = replace(CostModel.uniform(2), send_overhead=0.5, recv_overhead=0.25)
    # rank 0: F, B, a send of the activation and a recv of its gradient
    assert rank_work(plans[0], costs) == pytest.approx(3 + 0.5 + 0.25)
    bucket = AllReduce((0, 1), (TensorSpec("w", (256,), "float32"),))
    link = replace(costs, collective_overhead=0.125, bandwidth=1024.0, latency=0.0)
    assert link.collective(bucket) == pytest.approx(0.125 + 1024 / 1024.0)
    assert replace(link, collective_overhead=0.0).collective(bucket) == pytest.approx(1.0)


def test_the_cpu_preset_charges_host_time_and_the_gpus_none():
    cpu, h100 = DEVICES["cpu"], DEVICES["h100"]
    assert cpu.op_us > 0 and cpu.instruction_us > 0 and cpu.collective_us > 0 and cpu.cores_per_node >= 1
    assert cpu.handoff_us > cpu.p2p_us    # a wait costs more than a transfer whose data is there
    assert (h100.op_us, h100.instruction_us, h100.collective_us, h100.p2p_us, h100.handoff_us,
            h100.cores_per_node) == (0, 0, 0, 0, 0, 0)


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _compiled():
    import graphc
    from graphc import compiler

    class G(graphc.Graph):
        def __init__(self):
            super().__init__()
            self.model = _Two()
            self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))

        def build(self, x):
            loss = self.model(x).square().mean()
            loss.backward()
            return loss
    g = G()
    return compiler.compile(g, [torch.randn(4, 8)], 1), g


@pytest.mark.slow    # a compile and two counts on fake tensors: 6 s alone on the loaded machine
def test_device_costs_add_each_op_dispatched_on_cpu():
    from graphc.tools.costs import device_costs
    compiled, _ = _compiled()
    plain = device_costs(compiled, "cpu", op_us=0, instruction_us=0, collective_us=0, p2p_us=0, cores_per_node=0)
    host = device_costs(compiled, "cpu", op_us=10)
    ops = (host.forward[0] - plain.forward[0]) / 10e-6
    assert ops == pytest.approx(round(ops)) and ops > 3    # two linears and a relu at least
    assert host.backward[0] == pytest.approx(2 * host.forward[0])
    assert host.overhead == pytest.approx(DEVICES["cpu"].instruction_us * 1e-6)
    assert host.cores == DEVICES["cpu"].cores_per_node and plain.cores is None and plain.overhead == 0


def test_the_estimate_prefers_less_work_when_ranks_share_a_core():
    """8 ranks on one core: data 8 does the same ops as a pipeline of 8 with 8 micro-batches,
    but the pipeline adds transfers, so the shared-core bound ranks data 8 first; with a
    core each the pipeline's shorter compute per rank is no longer summed."""
    from graphc.auto.layout import Layout
    from graphc.auto.search import ModelFacts, estimate
    facts = ModelFacts(0.0, 0, 1000, 0, 8, (), 16, 5e9, 0.0, forward_host_s=8e-3,
                       instruction_s=1e-4, collective_s=1e-4, p2p_s=1e-4, cores=1)
    data = Layout(1, 1, 8, "1f1b", 1, 0, "never")
    pipe = Layout(8, 1, 1, "1f1b", 8, 0, "never")
    assert estimate(data, facts)[0] < estimate(pipe, facts)[0]
    shared = estimate(data, facts)[0]
    assert shared == pytest.approx(8 * (3 * 8e-3 + 2 * 1e-4 + 1e-4 + 7 / 8 * 1000 / 5e9), rel=1e-6)
    assert estimate(data, replace(facts, cores=0))[0] == pytest.approx(shared / 8, rel=1e-6)


@pytest.mark.slow    # a compile, then two replays with forked processes: 14 s at load 9
def test_concurrent_replay_keeps_what_replaying_alone_measures():
    from graphc.tools.costs import measure_costs
    compiled, g = _compiled()
    alone = measure_costs(compiled, g._optimizer, repeats=1)
    together = measure_costs(compiled, g._optimizer, repeats=1, concurrent=True)
    assert sorted(together.forward) == sorted(alone.forward) == [0]
    assert together.activation_bytes == alone.activation_bytes
    assert together.input_bytes == alone.input_bytes
    assert together.forward[0] > 0 and together.backward[0] > 0 and together.optimizer[0] > 0
    assert "at once" in together.source and "at once" not in alone.source
    assert SPEC.nbytes == 16384
