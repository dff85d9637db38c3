"""Unit tests of `graphc plan`'s helpers at scale: rows.py (folding, ranges), summary.py
(stages.txt), network.py (ring and tree costs against hand-computed values), dump's
--ranks selection, and the simulator's folding of symmetric ranks (exact)."""
import dataclasses
import os
import sys

import pytest

from graphc.errors import GraphcError
from graphc.plan.instructions import AllReduce, TensorSpec
from graphc.tools.simulate import engine as sim
from graphc.tools.costs import CostModel, device_costs
from graphc.tools.dump import ALL_RANKS_BELOW, parse_ranks, select_ranks
from graphc.tools.network import DEVICES, Network, collective_seconds, ring_steps
from graphc.tools.rows import fold_ranks, ranges, row_label
from graphc.tools.simulate import Span
from graphc.tools.summary import stage_summary

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))

import plan_scale  # noqa: E402


# -- rows.py --------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks,text", [([5], "5"), ([2, 3, 4, 7], "2-4, 7"), ([0, 2, 4], "0, 2, 4"),
                                        ([0, 1], "0-1"), ([1, 2, 3, 9, 10], "1-3, 9-10")])
def test_ranges(ranks, text):
    assert ranges(ranks) == text


def test_row_label():
    notes = {0: "stage 0", 1: "stage 0", 2: "stage 1", 3: "idle"}
    assert row_label([2], notes) == "rank 2 (stage 1)"
    assert row_label([2]) == "rank 2"
    assert row_label([0, 1], notes) == "ranks 0-1, stage 0"          # a note said once
    assert row_label([0, 1, 3], notes) == "ranks 0-1, 3, stage 0; idle"
    assert row_label([4, 5], notes) == "ranks 4-5"


def _spans(rank, times, kind="forward"):
    return [Span(rank, i, f"0F{i}", kind, i, t0, t1) for i, (t0, t1) in enumerate(times)]


def test_fold_ranks_groups_identical_timelines_in_rank_order():
    a, b = [(0, 1), (1, 3)], [(0, 1), (2, 3)]
    timeline = {3: _spans(3, a), 0: _spans(0, b), 1: _spans(1, a), 2: _spans(2, b), 4: _spans(4, a, "backward")}
    assert fold_ranks(timeline) == [[0, 2], [1, 3], [4]]
    assert fold_ranks({0: [], 1: []}) == [[0, 1]]


def test_fold_ranks_uses_the_timelines_signature():
    class Timeline(dict):
        def signature(self, rank):
            return rank % 2                      # spans are never built

        def __getitem__(self, rank):
            raise AssertionError("fold_ranks built a row's spans")

    timeline = Timeline.fromkeys(range(5))
    assert fold_ranks(timeline) == [[0, 2, 4], [1, 3]]


# -- network.py -----------------------------------------------------------------------------
LINK = (1e9, 1e-5)       # 1 GB/s, 10 us


def test_ring_steps():
    assert ring_steps("all_reduce", 4) == 6
    assert ring_steps("all_gather", 4) == ring_steps("reduce_scatter", 4) == 3


def test_large_all_reduce_takes_the_ring():
    # 4 MB over 4 ranks: ring sends 2*3/4*4e6 = 6e6 B in 6 steps: 6 ms + 60 us = 6.06 ms;
    # tree: 2 * (2 levels * 10 us + 4 ms) = 8.04 ms
    assert collective_seconds("all_reduce", 6_000_000, 4_000_000, 4, LINK) == pytest.approx(6.06e-3)


def test_small_all_reduce_takes_the_tree():
    # 400 B over 4 ranks: ring 600 B / 1e9 + 6 * 10 us = 60.6 us; tree 2 * (20 us + 0.4 us) = 40.8 us
    assert collective_seconds("all_reduce", 600, 400, 4, LINK) == pytest.approx(40.8e-6)
    # 5 ranks: the tree is ceil(log2 5) = 3 levels deep: 2 * (30 us + 0.4 us) = 60.8 us;
    # ring 2*4/5*400 = 640 B: 0.64 us + 8 * 10 us = 80.64 us
    assert collective_seconds("all_reduce", 640, 400, 5, LINK) == pytest.approx(60.8e-6)


def test_gather_and_scatter_are_rings():
    # all_gather of 4 MB over 4 ranks: each sends 3e6 B in 3 steps: 3 ms + 30 us
    assert collective_seconds("all_gather", 3_000_000, 0, 4, LINK) == pytest.approx(3.03e-3)
    assert collective_seconds("reduce_scatter", 3_000_000, 0, 4, LINK) == pytest.approx(3.03e-3)
    assert collective_seconds("all_reduce", 100, 100, 1, LINK) == 0.0


def test_network_of_a_preset_and_which_groups_cross_nodes():
    net = Network.of(DEVICES["h100"])
    assert (net.ranks_per_node, net.bandwidth) == (8, 50e9) and net.latency == pytest.approx(10e-6)
    assert not net.crosses([0, 7]) and not net.crosses([8, 15, 12])
    assert net.crosses([7, 8]) and net.crosses([0, 16])


def test_cost_model_charges_the_slowest_link():
    costs = dataclasses.replace(CostModel.uniform(1), bandwidth=1e9, latency=1e-5,
                                network=Network(4, 1e8, 1e-4))
    grads = (TensorSpec("w", (250_000,), "float32"),)          # 1 MB
    inside = AllReduce(ranks=(0, 1), tensors=grads)
    across = AllReduce(ranks=(3, 4), tensors=grads)
    # 2 ranks: ring sends 1 MB in 2 steps; tree 1 level: 2 * (latency + 1 MB / bandwidth)
    assert costs.collective(inside) == pytest.approx(min(1e6 / 1e9 + 2e-5, 2 * (1e-5 + 1e6 / 1e9)))
    assert costs.collective(across) == pytest.approx(min(1e6 / 1e8 + 2e-4, 2 * (1e-4 + 1e6 / 1e8)))
    assert costs.link(0, 3) == (1e9, 1e-5) and costs.link(3, 4) == (1e8, 1e-4)


# -- dump.py: --ranks -------------------------------------------------------------------------
def test_parse_ranks():
    assert parse_ranks("0,7,-1", 16) == [0, 7, 15]
    assert parse_ranks(" 3 , 3,-16,", 16) == [0, 3]
    for bad in ("16", "-17", "x", "1.5"):
        with pytest.raises(GraphcError, match="is not a rank"):
            parse_ranks(bad, 16)
    with pytest.raises(GraphcError, match="names no rank"):
        parse_ranks(" , ", 16)


class _Stage:
    def __init__(self, ranks):
        self.ranks = ranks


class _Compiled:
    def __init__(self, world, stages):
        self.plans = [None] * world
        self.stages = [_Stage(r) for r in stages]


def test_select_ranks():
    small = _Compiled(ALL_RANKS_BELOW - 1, [range(ALL_RANKS_BELOW - 1)])
    assert select_ranks(None, small) == (list(range(ALL_RANKS_BELOW - 1)), "")
    big = _Compiled(128, [range(0, 64), range(64, 128)])
    chosen, why = select_ranks(None, big)
    assert chosen == [0, 63, 64, 127] and "4 of 128 ranks" in why
    assert select_ranks("all", big) == (list(range(128)), "")
    chosen, why = select_ranks("5,-1", big)
    assert chosen == [5, 127] and "rank(s) 5, 127 of 128 (--ranks 5,-1)" in why


# -- summary.py and the folded simulation, on compiled MLPs -----------------------------------
def compile_mlp(monkeypatch, pp, dp, tp, m, schedule="1f1b"):
    from graphc import compiler
    from graphc.executable import input_specs
    world = pp * dp * tp
    for k, v in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", world)):
        monkeypatch.setenv(k, str(v))
    graph, inputs = plan_scale.mlp_graph(pp, dp, tp, m, schedule=schedule)
    specs = input_specs(inputs)
    example, layouts = [s.example() for s in specs], [s.layout for s in specs]
    return compiler.compile(graph, example, world, layouts)


def test_stage_summary(monkeypatch):
    compiled = compile_mlp(monkeypatch, 2, 2, 2, 4)
    text = stage_summary("MLPGraph", compiled, written=[0, 5])
    lines = text.splitlines()
    assert lines[0] == ("# graphc plan summary: MLPGraph, 8 rank(s), 2 stage(s), schedule=1f1b, "
                        "4 micro-batch(es), training")
    assert "stage 0: ranks 0-3 (4 rank(s))" in lines and "stage 1: ranks 4-7 (4 rank(s))" in lines
    # stage 0: 4 forwards and backwards, each sending to / receiving from stage 1
    assert "  18 instructions a step: 4 F, 4 B, 4 SEND, 4 RECV, 1 ALL_REDUCE, 1 OPTIMIZER_STEP" in lines
    f0 = compiled.plans[0]
    sent = sum(i.nbytes for i in f0.instructions if type(i).__name__ == "Send")
    assert f"    transfers a step: sends {sent / 2**20:.3f} MiB to stage 1, receives" in text
    assert "  plans written: rank0.txt" in lines and "  plans written: rank5.txt" in lines
    assert "instruction sequences" not in text
    # the gradient all-reduce of stage 0 spans its 2 data-parallel replicas
    assert "collectives a step: 1 all_reduce over 2 ranks" in text


def test_stage_summary_names_variants_and_idle_ranks(monkeypatch):
    compiled = compile_mlp(monkeypatch, 2, 2, 1, 2)
    plans = compiled.plans
    plans[1] = dataclasses.replace(plans[1], instructions=plans[1].instructions[:-1])
    compiled.plans = plans + [dataclasses.replace(plans[0], rank=4, instructions=[])]
    text = stage_summary("G", compiled)
    assert "  2 instruction sequences: ranks 0; ranks 1" in text
    assert "  ranks 1: " in text and "plans written: none (choose with --ranks)" in text
    assert text.splitlines()[-1] == "idle: ranks 4 hold no stage"


@pytest.mark.parametrize("pp,dp,tp,schedule,preset", [(2, 2, 2, "1f1b", "h100"), (4, 2, 2, "gpipe", "h100"),
                                                       (4, 2, 2, "1f1b", "a100"), (3, 3, 1, "1f1b", None)])
def test_folded_simulation_equals_every_rank(monkeypatch, pp, dp, tp, schedule, preset):
    """NOTE: Symmetric ranks: one rank per class runs, and the result is exact (16 ranks
    span two nodes of 8, so transfers between stages 1 and 2 cross the network)."""
    compiled = compile_mlp(monkeypatch, pp, dp, tp, 4, schedule)
    costs = device_costs(compiled, preset) if preset else CostModel.uniform(pp)
    variants = [costs, dataclasses.replace(costs, sends_complete_on_delivery=True, send_overhead=1e-6)]
    for costs in variants:
        folded = sim._Simulation(compiled.plans, costs, 3)
        folded.run()
        assert len(folded.running) < len(compiled.plans)
        every = sim._Simulation(compiled.plans, costs, 3, fold=False)
        every.run()
        for r in range(len(compiled.plans)):
            assert folded.starts[r].tobytes() == every.starts[r].tobytes(), r
            assert folded.ends[r].tobytes() == every.ends[r].tobytes(), r
        assert folded.result().table() == every.result().table()


def test_ranks_that_differ_are_not_folded(monkeypatch):
    """Stage 0 on ranks 0-1 and stage 1 on ranks 2-3 (data parallel 2). With nodes of one
    rank every transfer crosses the network: the replicas are alike (2 classes). With
    nodes of 3 ranks, 0 <-> 2 stays inside a node and 1 <-> 3 crosses: nothing folds."""
    compiled = compile_mlp(monkeypatch, 2, 2, 1, 2)
    base = dataclasses.replace(CostModel.uniform(2), latency=0.0, bandwidth=1e12)
    alike = sim._Simulation(compiled.plans, dataclasses.replace(base, network=Network(1, 1e3, 1e-3)), 2)
    assert alike.running == [0, 2] and alike.rep == {1: 0, 3: 2}
    costs = dataclasses.replace(base, network=Network(3, 1e3, 1e-3))
    apart = sim._Simulation(compiled.plans, costs, 2)
    assert apart.running == [0, 1, 2, 3] and apart.rep == {}
    apart.run()
    assert apart.ends[0].tobytes() != apart.ends[1].tobytes()
