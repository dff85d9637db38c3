"""ExecutionPlan.parse(str(plan)) gives the plan back exactly, for the plans of compiled graphs:
pipelines (1F1B with checkpointing, zero bubble's split backward, DualPipeV's overlapped F+B),
tensor parallelism (listed collectives), a tied GPT (tie all-reduce) with gradient clipping,
stages found from placements (a note), and a plan listing as a verifier error marks it."""
import os
import sys

import pytest
import torch
import torch.nn as nn

import graphc
from graphc import compiler
from graphc.plan.instructions import (BackwardInput, BackwardWeight, ClipGradNorm, Collective,
                                      OverlapFB, TieAllReduce)
from graphc.plan.plan import ExecutionPlan, StageInfo
from models import PipelineGraph, SkipNet
from transformer_models import GPTGraph, TinyGPT, token_batches

for _folder in ("passes", "runtime"):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", _folder))
from test_core_passes import _TensorParallel  # noqa: E402
from test_schedules_numerics import ChunkGraph  # noqa: E402  (SkipNet in a schedule's stage layout)
from test_place_by_layout import compile_seed, seed  # noqa: E402

X, Y = torch.randn(16, 16), torch.randint(0, 5, (16,))


def _pipeline(p, m, schedule, checkpointing="never"):
    graph = PipelineGraph(SkipNet(p), None, accumulation=m, schedule=schedule)
    graph.config.set_activation_checkpointing(checkpointing)
    return compiler.compile(graph, [X, Y], p)


def _chunked(schedule, m):
    model = SkipNet(4)   # two pipeline ranks, two stages each
    graph = ChunkGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), None, m, schedule)
    return compiler.compile(graph, [X, Y], 2)


def _tied_gpt_clipped():
    graph = GPTGraph(TinyGPT(layers=2), None, [graphc.placement("cpu", [r]) for r in range(2)])
    graph.config.set_grad_clip_norm(0.5)
    return compiler.compile(graph, list(token_batches(1)[0]), 2)


GRAPHS = {  # name -> (compile, an instruction kind its plans must hold, or None)
    "1f1b checkpointed": (lambda: _pipeline(4, 4, "1f1b", "except_last"), None),
    "zbv": (lambda: _chunked("zbv", 4), BackwardWeight),
    "dualpipev": (lambda: _chunked("dualpipev", 4), OverlapFB),
    "tensor parallel": (lambda: compiler.compile(
        _TensorParallel(), [torch.randn(8, 8), torch.randint(0, 4, (8,))], 2), Collective),
    "tied gpt, clipped": (_tied_gpt_clipped, TieAllReduce),
    "stages from placements": (lambda: compile_seed(seed.GlobalProgram), None),
}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_parse_gives_every_plan_back(name):
    make, kind = GRAPHS[name]
    plans = make().plans
    if kind is not None:
        assert any(isinstance(i, kind) for p in plans for i in p.instructions), kind
    for plan in plans:
        again = ExecutionPlan.parse(str(plan))
        assert again == plan
        assert str(again) == str(plan)
        assert again.stages == plan.stages and again.training == plan.training


def test_round_trip_keeps_what_the_header_says():
    zbv = _chunked("zbv", 4).plans[1]
    assert {type(i) for i in zbv.instructions} >= {BackwardInput, BackwardWeight}
    ckpt = _pipeline(2, 4, "1f1b", "always").plans[0]
    assert ExecutionPlan.parse(str(ckpt)).checkpointing == "always"
    clipped = _tied_gpt_clipped().plans[0]
    clip = next(i for i in ExecutionPlan.parse(str(clipped)).instructions if isinstance(i, ClipGradNorm))
    assert clip.max_norm == 0.5 and clip.params   # this rank's names, which == does not compare
    noted = compile_seed(seed.GlobalProgram).plans[0]
    assert ExecutionPlan.parse(str(noted)).notes == noted.notes and "stages" in noted.notes


def test_inference_plan_and_stage_ranks_print_compactly():
    plan = ExecutionPlan(9, 12, [], 2, "gpipe", (StageInfo(0, (0, 1, 2, 3, 8, 10), "cpu"),
                                                 StageInfo(1, (11, 9, 4, 5, 6, 7), "cuda")),
                         training=False)
    text = str(plan)
    assert "# pipeline stages: 0=cpu[0..3,8,10] 1=cuda[11,9,4..7]" in text and "inference" in text
    assert ExecutionPlan.parse(text) == plan and not ExecutionPlan.parse(text).notes


def test_a_marked_instruction_is_flagged_on_its_own_line():
    plan = compile_seed(seed.GlobalProgram).plans[0]   # header, stages line and a note
    marked = next(line for line in plan.format(3).splitlines() if "ERROR HERE" in line)
    assert marked.startswith(f"   3  {plan.instructions[3]}")
