"""Runtime traces: real gloo ranks record their timelines; rank 0 merges one Chrome trace."""
import json
import os

import pytest
import torch

from graphc.tools.chart import draw_timeline
from graphc.tools.trace import timeline_from_trace
from helpers import run_world
from models import PipelineGraph, SkipNet, make_batches

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

STEPS, TRACED = 3, 2


def _train(rank, world, path, use_env):
    if use_env:
        os.environ["GRAPHC_TRACE"] = path
    model = SkipNet(world)
    graph = PipelineGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation=2)
    if not use_env:
        graph.config.set_trace(path, steps=TRACED)
    x, y = make_batches(1)[0]
    for _ in range(STEPS):
        graph(x, y)
    return [str(i) for i in graph.plan.instructions]


def _check(path, plans, steps):
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    for rank, instrs in enumerate(plans):
        for step in range(steps):
            got = [e["name"] for e in events if e["pid"] == rank and e["args"]["step"] == step]
            assert got == [i.split(" ")[0] for i in instrs], (rank, step)
    assert {e["args"]["step"] for e in events} == set(range(steps))


def test_config_trace_merges_all_ranks(tmp_path):
    path = str(tmp_path / "trace.json")
    plans = run_world(_train, 2, path, False)
    _check(path, plans, TRACED)
    timeline = timeline_from_trace(path)
    assert sorted(timeline) == [0, 1]
    # rank 1 cannot run its first forward before rank 0 has sent to it
    f0 = next(s for s in timeline[0] if s.label == "0F0")
    f1 = next(s for s in timeline[1] if s.label == "1F0")
    assert f1.start >= f0.end
    assert draw_timeline(timeline, str(tmp_path / "measured"), "measured")


@pytest.mark.slow   # a second spawned world; the config test covers the merge
def test_env_trace_path(tmp_path):
    path = str(tmp_path / "env_trace.json")
    plans = run_world(_train, 2, path, True)
    _check(path, plans, 3)     # GRAPHC_TRACE traces the default 5 steps: all 3 here
