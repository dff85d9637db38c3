"""Tensor, hybrid and 2-D parallelism from SBP on real gloo processes equal eager PyTorch.

Each config trains STEPS steps and compares losses and the full (gathered) state dict
with eager PyTorch on the whole batch, float64, tolerance 1e-10 (the oracle of helpers.py):
  2 ranks: Megatron column/row-parallel MLP; attention block with heads split;
  4 ranks: data x pipeline; tensor x pipeline; data x tensor on a 2-D placement;
           seed 003's hybrid (stage 0 data parallel on [0, 1], stage 1 model parallel on [2, 3]).
"""
import math
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from graphc.plan.instructions import AllReduce
from helpers import assert_same_as_eager, eager_train, run_world
from models import OPTIMIZERS

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

STEPS = 3
D, CLASSES, BATCH, T, HEADS = 16, 5, 8, 4, 4


class MLPBlock(nn.Module):
    """Megatron MLP: fc1 column-parallel, fc2 row-parallel, then residual and LayerNorm."""

    def __init__(self, d=D):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.fc2(F.gelu(self.fc1(x))))


class MLPNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.block = MLPBlock()
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x):
        return self.head(self.block(self.embed(x)))


class Attention(nn.Module):
    """Self-attention on [batch, T, D]: q/k/v column-parallel (heads split), out row-parallel."""

    def __init__(self, d=D, heads=HEADS):
        super().__init__()
        # k has no bias: its gradient is zero in exact arithmetic (softmax ignores a shift),
        # and Adam would blow the rounding noise up to lr-sized steps
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d, bias=False), nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.heads, self.hd = heads, d // heads

    def forward(self, x):
        def heads(t):
            return t.view(-1, T, self.heads, self.hd).transpose(1, 2)
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        att = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.hd), dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(-1, T, self.heads * self.hd)
        return self.norm(x + self.out(y))


class AttentionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.attn = Attention()
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x):
        return self.head(self.attn(self.embed(x))).mean(1)


class EmbedNet(nn.Module):
    """Vocabulary-parallel embedding (partial_sum out), then cat, chunk/getitem and mean."""

    def __init__(self, vocab=32):
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, D)
        self.head = nn.Linear(2 * D, CLASSES)

    def forward(self, x):
        tokens = (x.abs() * 7).long() % self.vocab   # x is [batch, T] floats
        h = self.emb(tokens)
        h = torch.cat([h, torch.tanh(h)], dim=-1)
        a, b = torch.chunk(h, 2, dim=1)
        return self.head((a + b).mean(1))


class TwoStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.stage0 = MLPBlock()
        self.stage1 = nn.Sequential(MLPBlock(), nn.Linear(D, CLASSES))

    def forward(self, x):
        return self.stage1(self.stage0(x))


class TrainGraph(graphc.Graph):
    def __init__(self, model, opt, accumulation, stages=()):
        super().__init__()
        self.model = model
        for name, sid, where in stages:
            getattr(self.model, name).config.set_stage(sid, where)
        self.loss_fn = nn.CrossEntropyLoss()
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def megatron(block, where, axis_sbp=lambda s: s):
    """fc1 split by output features (column), fc2's weight by input features (row)."""
    graphc.to_global(block.fc1, placement=where, sbp=axis_sbp(sbp.split(0)))
    graphc.to_global(block.fc2.weight, placement=where, sbp=axis_sbp(sbp.split(1)))


def batches(shape, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=g), torch.randint(0, CLASSES, (shape[0],), generator=g))
            for _ in range(STEPS)]


def _rows(t, k, n):
    return t.chunk(n)[k]


# -- configs: (make model, set up layouts, stages, how to feed x/y on this rank) ------------
def _mlp_tp(rank, world):
    where = graphc.placement("cpu", [0, 1])
    model = MLPNet()
    graphc.to_global(model, placement=where, sbp=sbp.broadcast)
    megatron(model.block, where)
    return model, (), lambda x, y: (x, y)


def _attention_tp(rank, world):
    where = graphc.placement("cpu", [0, 1])
    model = AttentionNet()
    graphc.to_global(model, placement=where, sbp=sbp.broadcast)
    for lin in (model.attn.q, model.attn.k, model.attn.v):
        graphc.to_global(lin, placement=where, sbp=sbp.split(0))
    graphc.to_global(model.attn.out.weight, placement=where, sbp=sbp.split(1))
    return model, (), lambda x, y: (x, y)


def _embedding_tp(rank, world):
    where = graphc.placement("cpu", [0, 1])
    model = EmbedNet()
    graphc.to_global(model, placement=where, sbp=sbp.broadcast)
    graphc.to_global(model.emb.weight, placement=where, sbp=sbp.split(0))  # rows = vocabulary
    return model, (), lambda x, y: (x, y)


def _data_pipeline(rank, world):
    p0, p1 = graphc.placement("cpu", [0, 1]), graphc.placement("cpu", [2, 3])
    model = TwoStage()
    k = rank % 2

    def feed(x, y):
        return (graphc.to_global(_rows(x, k, 2), placement=p0, sbp=sbp.split(0)),
                graphc.to_global(_rows(y, k, 2), placement=p1, sbp=sbp.split(0)))
    return model, (("stage0", 0, p0), ("stage1", 1, p1)), feed


def _tensor_pipeline(rank, world):
    p0, p1 = graphc.placement("cpu", [0, 1]), graphc.placement("cpu", [2, 3])
    model = TwoStage()
    graphc.to_global(model.stage0, placement=p0, sbp=sbp.broadcast)
    graphc.to_global(model.stage1, placement=p1, sbp=sbp.broadcast)
    megatron(model.stage0, p0)
    megatron(model.stage1[0], p1)
    return model, (("stage0", 0, p0), ("stage1", 1, p1)), lambda x, y: (x, y)


def _n_to_m(sizes):
    """Stage 0 on `sizes[0]` ranks, stage 1 on the next `sizes[1]`, both data parallel:
    values cross in pieces (n-to-m, NOTE: Reshard pieces), each stage's own ranks split the batch."""
    def setup(rank, world):
        r0 = list(range(sizes[0]))
        r1 = list(range(sizes[0], sizes[0] + sizes[1]))
        p0, p1 = graphc.placement("cpu", r0), graphc.placement("cpu", r1)
        model = TwoStage()

        def feed(x, y):
            k0, k1 = (r0.index(rank) if rank in r0 else 0), (r1.index(rank) if rank in r1 else 0)
            return (graphc.to_global(_rows(x, k0, len(r0)), placement=p0, sbp=sbp.split(0)),
                    graphc.to_global(_rows(y, k1, len(r1)), placement=p1, sbp=sbp.split(0)))
        return model, (("stage0", 0, p0), ("stage1", 1, p1)), feed
    return setup


def _data_tensor_2d(rank, world):
    mesh = graphc.placement("cpu", [[0, 1], [2, 3]])
    model = MLPNet()
    graphc.to_global(model, placement=mesh, sbp=(sbp.broadcast, sbp.broadcast))
    megatron(model.block, mesh, lambda s: (sbp.broadcast, s))
    i = rank // 2  # row of the mesh: axis 0 (data) coordinate

    def feed(x, y):
        return (graphc.to_global(_rows(x, i, 2), placement=mesh, sbp=(sbp.split(0), sbp.broadcast)),
                graphc.to_global(_rows(y, i, 2), placement=mesh, sbp=(sbp.split(0), sbp.broadcast)))
    return model, (), feed


CONFIGS = {
    2: {"mlp_tp": (_mlp_tp, MLPNet, (BATCH, D), 2),
        "attention_tp": (_attention_tp, AttentionNet, (BATCH, T, D), 1),
        "embedding_tp": (_embedding_tp, EmbedNet, (BATCH, T), 2)},
    4: {"data_x_pipeline": (_data_pipeline, TwoStage, (BATCH, D), 2),
        "tensor_x_pipeline": (_tensor_pipeline, TwoStage, (BATCH, D), 2),
        "data_x_tensor_2d": (_data_tensor_2d, MLPNet, (2 * BATCH, D), 2),
        # accumulation 1: micro-batch k holds every rank's k-th chunk, so with accumulation
        # a batch split over 2 ranks and one over 1 rank would group rows differently
        "n_to_m_2_to_1": (_n_to_m((2, 1)), TwoStage, (BATCH, D), 1),
        "n_to_m_1_to_2": (_n_to_m((1, 2)), TwoStage, (BATCH, D), 1)},
}

SPLIT_PARAMS = {"mlp_tp": ("fc1.", "fc2.weight"), "tensor_x_pipeline": ("fc1.", "fc2.weight"),
                "attention_tp": ("attn.q.", "attn.k.", "attn.v.", "attn.out.weight"),
                "embedding_tp": ("emb.",)}


def _train(rank, world):
    out = {}
    for name, (setup, _, shape, acc) in CONFIGS[world].items():
        torch.manual_seed(0)
        model, stages, feed = setup(rank, world)
        graph = TrainGraph(model, OPTIMIZERS["adam"](model.parameters()), acc, stages)
        losses = []
        for x, y in batches(shape):
            loss = graph(*feed(x, y)).to_local()
            if loss.numel():
                losses.append(loss.item())
        syncs = [t.name for ins in graph.plan.instructions if type(ins) is AllReduce
                 for t in ins.tensors]
        out[name] = {"losses": losses, "state": graph.full_state_dict(), "synced": syncs,
                     "plan": str(graph.plan), "printed": str(graph)}
    if world == 4:
        import hybrid
        out["hybrid"] = hybrid.main(steps=STEPS)
    return out


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])   # CI time: tensor 2 and hybrid layouts run by default in test_global_tensors and the local sweep (tests/local/test_sweep.py), held bitwise to gloo with tp2 by tests/local/test_local_vs_gloo.py
def test_tensor_and_hybrid_parallel_match_eager(world):
    results = run_world(_train, world)
    for name, (_, make, shape, _) in CONFIGS[world].items():
        torch.manual_seed(0)
        ref_losses, ref_state = eager_train(make(), OPTIMIZERS["adam"], None, nn.CrossEntropyLoss(),
                                            batches(shape), STEPS)
        for rank, res in enumerate(results):
            got = res[name]
            what = f"{name} rank {rank}"
            if got["losses"]:
                assert_same_as_eager(got["losses"], got["state"], ref_losses, ref_state, what)
            else:  # a rank outside the loss's stage: the full state still matches
                assert_same_as_eager([], got["state"], [], ref_state, what)
            # a split parameter's gradient is split: never all-reduced (without a data axis)
            if name in SPLIT_PARAMS:
                assert not [s for s in got["synced"] if any(p in s for p in SPLIT_PARAMS[name])], \
                    f"{what}: {got['synced']}"
    if world == 4:
        ref = results[0]["hybrid"]["reference"]
        for rank, res in enumerate(results):
            got = res["hybrid"]
            what = f"hybrid example rank {rank}"
            if got["losses"]:
                assert_same_as_eager(got["losses"], got["state"], ref["losses"], ref["state"], what)
