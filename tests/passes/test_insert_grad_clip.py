"""insert_grad_clip: with set_grad_clip_norm, every rank that runs a stage issues one
ClipGradNorm right before its optimizer step (after every gradient all-reduce), over the same
ranks, and over all ranks each parameter's gradient (each shard of a split one, a tied one
once) is counted exactly once. Without clipping, or for inference, plans are unchanged."""
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from graphc.passes.insert_grad_clip import insert_grad_clip
from graphc.plan.instructions import AllReduce, ClipGradNorm, OptimizerStep
from helpers import compile_graph, global_input
from models import PipelineGraph, SkipNet
from transformer_models import GPTGraph, TinyGPT, token_batches

P01 = graphc.placement("cpu", [0, 1])
MAX_NORM = 0.5


def clipped(graph):
    graph.config.set_grad_clip_norm(MAX_NORM)
    return graph


class Megatron(graphc.Graph):
    """A broadcast linear, then a column- and a row-parallel one, on ranks 0 and 1; with
    data=True the model is broadcast and the rows split instead (data parallel)."""

    def __init__(self, data=False):
        super().__init__()
        model = graphc.to_global(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(16, 4)),
                                 placement=P01, sbp=sbp.broadcast)
        if not data:
            graphc.to_global(model[1], placement=P01, sbp=sbp.split(0))
            graphc.to_global(model[2].weight, placement=P01, sbp=sbp.split(1))
        self.model = model
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def clip_of(plan):
    found = [(i, ins) for i, ins in enumerate(plan.instructions) if isinstance(ins, ClipGradNorm)]
    assert len(found) == 1, str(plan)
    return found[0]


def check_placed(plans, ranks):
    """One clip per rank, right before the optimizer step and after every all-reduce."""
    for plan in plans:
        at, clip = clip_of(plan)
        assert isinstance(plan.instructions[at + 1], OptimizerStep)
        assert not [i for i in plan.instructions[at + 1:] if type(i) is AllReduce]
        assert clip.ranks == ranks and clip.max_norm == MAX_NORM


def test_tensor_parallel_counts_replicas_once_and_every_shard():
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    cg = compile_graph(clipped(Megatron()), [x, y], 2)
    check_placed(cg.plans, (0, 1))
    counted = [set(clip_of(p)[1].params) for p in cg.plans]
    whole = {"model.0.weight", "model.0.bias", "model.2.bias"}
    split = {"model.1.weight", "model.1.bias", "model.2.weight"}
    assert counted[0] == whole | split      # rank 0: the replicas and its shards
    assert counted[1] == split              # rank 1: its shards only


def test_data_parallel_replicas_are_counted_by_the_first_rank():
    x, y = global_input(torch.randn(6, 8), P01, sbp.split(0)), torch.randint(0, 4, (6,))
    cg = compile_graph(clipped(Megatron(data=True)), [x, global_input(y, P01, sbp.split(0))], 2)
    check_placed(cg.plans, (0, 1))
    assert len(clip_of(cg.plans[0])[1].params) == 6 and clip_of(cg.plans[1])[1].params == ()


def test_pipeline_stages_count_their_own_parameters():
    model = SkipNet(2)
    cg = compile_graph(clipped(PipelineGraph(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                             accumulation=2)),
                       [torch.randn(8, 16), torch.randint(0, 5, (8,))], 2)
    check_placed(cg.plans, (0, 1))
    programs = {p.stage: {n for n, _ in p.module.named_parameters()} for p in cg.programs}
    for plan in cg.plans:
        assert set(clip_of(plan)[1].params) == programs[plan.rank]


def test_a_parameter_tied_across_stages_is_counted_by_its_first_stage():
    model = TinyGPT()
    stages = [graphc.placement("cpu", [0]), graphc.placement("cpu", [1])]
    graph = clipped(GPTGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), stages))
    cg = compile_graph(graph, list(token_batches(1)[0]), 2)
    counted = Counter(name for p in cg.plans for name in clip_of(p)[1].params)
    tied = [name for name in counted if "wte" in name or "lm_head" in name]
    assert tied and all(name in clip_of(cg.plans[0])[1].params for name in tied)
    assert not [name for name in clip_of(cg.plans[1])[1].params if "wte" in name or "lm_head" in name]
    assert set(counted.values()) == {1}


@pytest.mark.parametrize("max_norm, training", [(None, True), (MAX_NORM, False)])
def test_without_clipping_or_training_the_plans_are_unchanged(max_norm, training):
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    cg = compile_graph(Megatron(), [x, y], 2)
    for plan in cg.plans:
        plan.training = training
    before = [list(p.instructions) for p in cg.plans]
    out = insert_grad_clip(cg.plans, cg.programs, cg.meshes, max_norm)
    assert [p.instructions for p in out] == before
