"""A torchvision-shaped VisionTransformer on tensor 2: nn.MultiheadAttention split by heads.

The model copies torchvision's vision_transformer.py layout (conv_proj patches, a class
token, Encoder with pos_embedding and layers as a Sequential of an OrderedDict, EncoderBlock
with ln_1, self_attention = nn.MultiheadAttention(batch_first=True) called as
`self_attention(x, x, x, need_weights=False)`, ln_2, MLPBlock, heads.head), small. torchvision
itself is not installed here: its PyPI wheel (0.28.0) is a CUDA build whose operators do not
register beside the CPU torch 2.13 ("operator torchvision::nms does not exist").
Layout: Megatron's, declared with to_global: in_proj_weight/in_proj_bias split(0) (heads),
out_proj.weight split(1), the MLP's first Linear split(0) and its second split(1).
decompose_modules rewrites each MultiheadAttention into projections, heads, SDPA and out_proj
(NOTE: MultiheadAttention by heads). Plan: no fallback, Megatron's 2 all-reduces forward and
2 backward per layer. Numerics: tensor 2 on gloo, and a sequence-first module (batch_first
False) on tensor 2, train like eager on the whole batch, float64 within 1e-10.
Data 2 (the batch split, every parameter whole): no fallback and no collective but the
loss's (the class token expands into each rank's rows; before, the batch was all-reduced at
the class token's cat), and eager's numbers on gloo. Pipeline 2 at accumulation 2, staged
by indexing the OrderedDict encoder (`encoder.layers[1].config.set_stage(1, ...)`), too.
"""
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from graphc.meta import META_SBP
from graphc.plan.instructions import Collective, OutputAllReduce
from helpers import (ATTENTION_LAYOUT_IDS, ATTENTION_LAYOUTS, assert_same_as_eager, compile_graph, eager_train,
                     feed_split, global_input, graphc_train, run_world)
from models import OPTIMIZERS

STEPS, BATCH, CLASSES = 3, 4, 5
IMAGE, PATCH, HIDDEN, HEADS, MLP, LAYERS = 8, 4, 16, 4, 32, 2
P01 = graphc.placement("cpu", [0, 1])


class MLPBlock(nn.Sequential):
    def __init__(self, hidden, mlp):
        super().__init__(nn.Linear(hidden, mlp), nn.GELU(), nn.Dropout(0.0), nn.Linear(mlp, hidden),
                         nn.Dropout(0.0))


class EncoderBlock(nn.Module):
    def __init__(self, batch_first=True):
        super().__init__()
        self.batch_first = batch_first
        self.ln_1 = nn.LayerNorm(HIDDEN, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(HIDDEN, HEADS, dropout=0.0, batch_first=batch_first)
        self.dropout = nn.Dropout(0.0)
        self.ln_2 = nn.LayerNorm(HIDDEN, eps=1e-6)
        self.mlp = MLPBlock(HIDDEN, MLP)

    def forward(self, input):
        x = self.ln_1(input)
        if not self.batch_first:
            x = x.transpose(0, 1)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        if not self.batch_first:
            x = x.transpose(0, 1)
        x = self.dropout(x)
        x = x + input
        y = self.ln_2(x)
        y = self.mlp(y)
        return x + y


class Encoder(nn.Module):
    def __init__(self, seq, batch_first):
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq, HIDDEN).normal_(std=0.02))
        self.dropout = nn.Dropout(0.0)
        self.layers = nn.Sequential(OrderedDict(
            (f"encoder_layer_{i}", EncoderBlock(batch_first)) for i in range(LAYERS)))
        self.ln = nn.LayerNorm(HIDDEN, eps=1e-6)

    def forward(self, input):
        return self.ln(self.layers(self.dropout(input + self.pos_embedding)))


class VisionTransformer(nn.Module):
    def __init__(self, batch_first=True):
        super().__init__()
        self.conv_proj = nn.Conv2d(3, HIDDEN, kernel_size=PATCH, stride=PATCH)
        self.class_token = nn.Parameter(torch.zeros(1, 1, HIDDEN))
        self.encoder = Encoder((IMAGE // PATCH) ** 2 + 1, batch_first)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(HIDDEN, CLASSES)))

    def forward(self, x):
        n, _, h, w = x.shape
        x = self.conv_proj(x).reshape(n, HIDDEN, (h // PATCH) * (w // PATCH)).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        return self.heads(self.encoder(x)[:, 0])


def megatron(model):
    graphc.to_global(model, placement=P01, sbp=sbp.broadcast)
    for block in model.encoder.layers:
        attn = block.self_attention
        for p, dim in ((attn.in_proj_weight, 0), (attn.in_proj_bias, 0), (attn.out_proj.weight, 1),
                       (block.mlp[0].weight, 0), (block.mlp[0].bias, 0), (block.mlp[3].weight, 1)):
            graphc.to_global(p, placement=P01, sbp=sbp.split(dim))
    return model


class ViTGraph(graphc.Graph):
    def __init__(self, model, opt, pipeline=False):
        super().__init__()
        self.model = model
        if pipeline:
            p0, p1 = graphc.placement("cpu", [0]), graphc.placement("cpu", [1])
            self.model.conv_proj.config.set_stage(0, p0)
            self.model.encoder.layers[0].config.set_stage(0, p0)
            for later in (self.model.encoder.layers[1], self.model.encoder.ln, self.model.heads):
                later.config.set_stage(1, p1)
            self.config.set_gradient_accumulation_steps(2)
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _batches():
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
            for _ in range(STEPS)]


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "sequence_first"])
def test_vit_tensor_parallel_issues_megatrons_collectives(batch_first):
    torch.manual_seed(0)
    model = megatron(VisionTransformer(batch_first))
    graph = ViTGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cg = compile_graph(graph, list(_batches()[0]), 2)
    assert not [n for n in cg.gm.graph.nodes if n.op == "call_module" and "self_attention" in str(n.target)]
    fallbacks = [n.name for n in cg.gm.graph.nodes if META_SBP in n.meta and n.meta[META_SBP].fallback]
    assert not fallbacks, fallbacks
    for plan in cg.plans:
        comms = [i for i in plan.instructions if isinstance(i, Collective)]
        assert {i.kind for i in comms} == {"all_reduce"}, "\n".join(map(str, comms))
        assert len([i for i in comms if i.direction == "F"]) == 2 * LAYERS, "\n".join(map(str, comms))
        assert len([i for i in comms if i.direction == "B"]) == 2 * LAYERS, "\n".join(map(str, comms))


def test_vit_data_parallel_keeps_the_batch_split():
    torch.manual_seed(0)
    model = graphc.to_global(VisionTransformer(), placement=P01, sbp=sbp.broadcast)
    graph = ViTGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cg = compile_graph(graph, [global_input(t, P01, sbp.split(0)) for t in _batches()[0]], 2)
    fallbacks = [n.name for n in cg.gm.graph.nodes if META_SBP in n.meta and n.meta[META_SBP].fallback]
    assert not fallbacks, fallbacks
    comms = [i for i in cg.plans[0].instructions if isinstance(i, Collective)]
    assert not comms, "\n".join(map(str, comms))   # no collective inside the stage program
    assert len([i for i in cg.plans[0].instructions if isinstance(i, OutputAllReduce)]) == 1   # the loss's mean, once per step


def _train(rank, world, batch_first, layout):
    torch.manual_seed(0)
    model = VisionTransformer(batch_first)
    if layout == "tensor":
        megatron(model)
    elif layout == "data":
        graphc.to_global(model, placement=P01, sbp=sbp.broadcast)
    graph = ViTGraph(model, OPTIMIZERS["sgd_momentum"](model.parameters()), pipeline=layout == "pipeline")
    losses, state = graphc_train(graph, _batches(), feed=feed_split(P01, rank) if layout == "data" else None)
    return {"losses": losses, "state": state}


@pytest.mark.world
@pytest.mark.parametrize("batch_first, layout",
                         ATTENTION_LAYOUTS + [pytest.param(True, "pipeline", marks=pytest.mark.slow)],
                         ids=ATTENTION_LAYOUT_IDS + ["pipeline2"])
def test_vit_matches_eager(batch_first, layout):
    torch.manual_seed(0)
    want_losses, want_state = eager_train(VisionTransformer(batch_first), OPTIMIZERS["sgd_momentum"], None,
                                          F.cross_entropy, _batches(), STEPS)
    for rank, got in enumerate(run_world(_train, 2, batch_first, layout)):
        # a pipeline's first stage holds no loss
        assert_same_as_eager(got["losses"], got["state"], want_losses if got["losses"] else [], want_state,
                             f"ViT (MultiheadAttention, batch_first={batch_first}) {layout} 2, rank {rank}")
