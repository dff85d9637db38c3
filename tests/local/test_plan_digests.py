"""The startup check (NOTE: Plan digests): each rank compiles only its own plan, and the
ranks compare digests of what their peers must pair with before the first step. Run in the
local world (every rank a thread, the real agreement exchange through its store)."""
import dataclasses
import re
import os
import sys

import pytest
import torch

import graphc
from graphc import compiler
from graphc.plan.instructions import AllReduce
from graphc.plan.templates import PlanWorld

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from layouts import Pair, SquaredError, assert_same, batches, eager, train  # noqa: E402


def test_a_peer_with_another_gradient_bucket_stops_every_rank(monkeypatch):
    compile_ = compiler.compile

    def rank_1_differs(*args, **kw):   # a deliberately mismatched peer: its bucket is another
        compiled = compile_(*args, **kw)
        if kw.get("ranks") == [1]:
            plan = compiled.plan_for(1)
            for i, ins in enumerate(plan.instructions):
                if type(ins) is AllReduce:
                    plan.instructions[i] = dataclasses.replace(ins, tensors=ins.tensors[:-1])
                    break
        return compiled
    monkeypatch.setattr(compiler, "compile", rank_1_differs)
    with pytest.raises(graphc.GraphcError) as e:
        train("dp2", lambda layout: SquaredError(Pair(), layout), batches(1))
    text = str(e.value)
    assert re.search(r"the ranks' plans do not pair up: collective #\d+ of the collectives over 0,1: ", text), text
    assert "rank 0 lists `ALL_REDUCE ranks=[0, 1]" in text and "rank 1 lists `ALL_REDUCE ranks=[0, 1]" in text
    assert "instruction #" in text and "graphc plan" in text


def _seeded_pair():
    torch.manual_seed(0)
    return Pair()


def test_ranks_compiling_their_own_plans_train_as_eager():
    data = batches(2)
    graphs = []
    got = train("pp2xdp2", lambda layout: SquaredError(_seeded_pair(), layout), data, graphs=graphs)
    # the oracle: eager PyTorch on the whole batch, float64, 1e-10
    assert_same(got, eager(_seeded_pair(), data), "pp2xdp2")
    for rank, graph in enumerate(graphs):
        assert [p.rank for p in graph.compiled.plans] == [rank] and graph.compiled.world_size == 4


def test_every_rank_may_verify_the_whole_world(monkeypatch):
    monkeypatch.setenv("GRAPHC_VERIFY_PLANS", "world")   # the old startup: every rank's plans, verified
    data = batches(1)
    graphs = []
    got = train("pp2", lambda layout: SquaredError(_seeded_pair(), layout), data, graphs=graphs)
    assert_same(got, eager(_seeded_pair(), data), "pp2")
    assert all(g.compiled.whole_world and len(g.compiled.plans) == 2 for g in graphs)
    assert [r.name for r in graphs[0].compiled.history].count("verify_plans") == 1


def test_every_rank_verifying_a_world_of_templates_trains_as_eager(monkeypatch):
    # pipeline 2 x data 2: each rank holds the world as templates (NOTE: Plan templates) and
    # runs its instance, which trains exactly as eager on the whole batch (float64, 1e-10)
    monkeypatch.setenv("GRAPHC_VERIFY_PLANS", "world")
    data = batches(2)
    graphs = []
    got = train("pp2xdp2", lambda layout: SquaredError(_seeded_pair(), layout), data, graphs=graphs)
    assert_same(got, eager(_seeded_pair(), data), "pp2xdp2")
    assert all(isinstance(g.compiled.plans, PlanWorld) and sorted(g.compiled.plans.templates) == [0, 2]
               for g in graphs)
