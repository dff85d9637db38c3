"""torch.profiler sees graphc's plan: one record_function range per instruction, and the
shared-memory transport's polling adds no tensor ops (no aten::item per poll)."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from graphc.plan.instructions import (ACT, AllReduce, Backward, Collective, Forward, OptimizerStep,
                                      Send, TensorSpec, TieAllReduce)
from graphc.runtime.actors import range_names
from helpers import run_world
from models import PipelineGraph, SkipNet, make_batches

MAX_ITEMS = 5    # "a handful": before, shared-memory polling alone made hundreds per step


def test_range_names_follow_the_listing():
    g = (TensorSpec("w.grad", (4, 4), "float32"),)
    plan = [Forward(1, 3), Send(0, 3, 1, ACT, 1, g), Backward(1, 0),
            AllReduce((0, 1), g), AllReduce((0, 1), g), TieAllReduce((0, 1), g, params=("w",)),
            OptimizerStep()]
    assert range_names(plan) == ["1F3", "0SEND_F3 to=1 stage=1", "1B0",
                                 "ALL_REDUCE bucket 0 ranks=[0, 1]",
                                 "ALL_REDUCE bucket 1 ranks=[0, 1]",
                                 "TIE_ALL_REDUCE ranks=[0, 1]", "OPTIMIZER_STEP"]


def test_collectives_inside_compute_get_no_range_of_their_own():
    c = Collective(kind="all_reduce", stage=0, microbatch=0, direction=ACT, ranks=(0, 1),
                   node="linear", sbp_in="partial_sum", sbp_out="broadcast", nbytes=64)
    assert range_names([c]) == [None]


def _profiled_step(rank, world):
    torch.manual_seed(0)
    model = SkipNet(2)
    graph = PipelineGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), None, 4)
    x, y = make_batches(1)[0]
    graph(x, y)                      # compiles; the profile holds one steady step
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        graph(x, y)
    names = [e.name for e in prof.events()]
    return {"names": set(names), "items": names.count("aten::item"),
            "plan": [str(i).split(" [")[0] for i in graph.plan.instructions],
            "transport": set(graph._runtime.p2p.kinds.values())}


@pytest.mark.world
def test_profile_of_a_pipeline_step_shows_the_plan_and_no_polling_ops():
    results = run_world(_profiled_step, 2)
    assert results[0]["transport"] == {"shm"}           # the polling transport is the one checked
    for rank, r in enumerate(results):
        assert set(r["plan"]) <= r["names"], (rank, set(r["plan"]) - r["names"])
        assert r["items"] <= MAX_ITEMS, f"rank {rank}: {r['items']} aten::item events"
    assert {"0F0", "0SEND_F3 to=1 stage=1", "0B3", "OPTIMIZER_STEP"} <= results[0]["names"]
    assert {"1RECV_F0 from=0 stage=0", "1F3", "1SEND_B0 to=0 stage=0"} <= results[1]["names"]
