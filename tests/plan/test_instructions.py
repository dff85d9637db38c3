"""Plan IR: instructions print, parse back, and round-trip through JSON."""
import json

import torch

from graphc import compiler
from graphc.plan.instructions import parse_instruction
from graphc.plan.plan import PLAN_FORMAT, ExecutionPlan
from models import PipelineGraph, SkipNet
import pytest

# plan-level checks of byte counts written for fp32 values (4 bytes): not numerics
pytestmark = pytest.mark.fp32


def _plans():
    g = PipelineGraph(SkipNet(4), torch.optim.SGD(SkipNet(4).parameters(), lr=0.1), accumulation=4)
    return compiler.compile(g, [torch.randn(16, 16), torch.randint(0, 5, (16,))], 4).plans


def test_every_instruction_parses_back():
    for plan in _plans():
        for ins in plan.instructions:
            assert parse_instruction(str(ins)) == ins


def test_plan_text_and_json_round_trip():
    for plan in _plans():
        assert ExecutionPlan.parse(str(plan)).instructions == plan.instructions
        d = json.loads(json.dumps(plan.to_json()))
        assert d["format"] == PLAN_FORMAT and d["rank"] == plan.rank and d["world_size"] == 4
        assert ExecutionPlan.from_json(d).instructions == plan.instructions
        ops = {i["op"] for i in d["instructions"]}
        assert {"forward", "backward", "optimizer_step"} <= ops


def test_json_has_the_contract_fields():
    d = _plans()[0].to_json()
    first = d["instructions"][0]
    assert first == {"op": "forward", "stage": 0, "microbatch": 0}
    send = d["instructions"][1]
    assert send["op"] == "send" and send["peer"] == 1 and send["microbatch"] == 0
    assert send["bytes"] == 4 * 16 * 4
