"""A misuse raises the same GraphcError on every rank, before any transfer: no rank waits.

Real gloo processes (run_world): a 2-stage pipeline whose batch does not divide into the
accumulation steps, and one whose input changes its number of dimensions on the second call
(a new batch size would compile a second plan instead). Each rank catches
the error and returns its message; the world must finish (run_world's timeout bounds it)
with both ranks reporting the same message.
"""
import pytest
import torch

import graphc
from helpers import run_world
from models import PipelineGraph, SkipNet

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)


def _misuses(rank, world):
    messages = []
    model = SkipNet(world)
    graph = PipelineGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation=4)
    try:
        graph(torch.randn(6, 16), torch.randint(0, 5, (6,)))
    except graphc.GraphcError as e:
        messages.append(str(e))
    graph = PipelineGraph(SkipNet(world), None, accumulation=2)
    graph(torch.randn(8, 16), torch.randint(0, 5, (8,)))
    try:
        graph(torch.randn(8, 16, 1), torch.randint(0, 5, (8,)))
    except graphc.GraphcError as e:
        messages.append(str(e))
    return messages


def test_every_rank_raises_the_same_error():
    results = run_world(_misuses, 2, timeout=180)
    assert len(results[0]) == 2, results
    assert results[0] == results[1]
    assert "not divisible by the 4 gradient accumulation steps" in results[0][0]
    assert "input 0 of PipelineGraph has shape [8, 16, 1]" in results[0][1]
