"""nn.MultiheadAttention's other calls by heads: masks and cross-attention (NOTE:
MultiheadAttention by heads, graphc/passes/decompose_attention.py).

A decoder-style block: causal self-attention with a boolean attn_mask [L, L] and an additive
one, and cross-attention to a memory of another length with a boolean key_padding_mask
[B, S] (padded keys), both modules batch-first or sequence-first. On tensor 2 (Megatron's
layout declared on both modules) the plan has no fallback and one all-reduce forward per
attention and one backward per attention whose input needs a gradient; on 2 gloo ranks, tensor 2 and data 2 train like eager in
float64 within 1e-10.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from graphc.meta import META_SBP
from graphc.plan.instructions import Collective
from helpers import (ATTENTION_LAYOUT_IDS, ATTENTION_LAYOUTS, assert_same_as_eager, compile_graph, eager_train,
                     feed_split, graphc_train, run_world)
from models import OPTIMIZERS

STEPS, BATCH, L, S, E, HEADS = 3, 4, 6, 5, 16, 4
P01 = graphc.placement("cpu", [0, 1])


class Block(nn.Module):
    def __init__(self, batch_first):
        super().__init__()
        self.batch_first = batch_first
        self.self_attn = nn.MultiheadAttention(E, HEADS, batch_first=batch_first)
        self.cross_attn = nn.MultiheadAttention(E, HEADS, batch_first=batch_first)
        self.head = nn.Linear(E, 3)
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
        self.register_buffer("causal", causal)
        self.register_buffer("bias", torch.zeros(L, L).masked_fill(causal, -1e4) + 0.1 * torch.randn(L, L))

    def forward(self, x, memory, padded):
        if not self.batch_first:
            x, memory = x.transpose(0, 1), memory.transpose(0, 1)
        h = x + self.self_attn(x, x, x, attn_mask=self.causal, need_weights=False)[0]
        h = h + self.self_attn(h, h, h, attn_mask=self.bias)[0]
        h = h + self.cross_attn(h, memory, memory, key_padding_mask=padded, need_weights=False)[0]
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.head(h)


class AttnGraph(graphc.Graph):
    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.add_optimizer(opt)

    def build(self, x, memory, padded, y):
        loss = F.cross_entropy(self.model(x, memory, padded).flatten(0, 1), y.flatten())
        loss.backward()
        return loss


def _megatron(model):
    graphc.to_global(model, placement=P01, sbp=sbp.broadcast)
    for attn in (model.self_attn, model.cross_attn):
        for p, dim in ((attn.in_proj_weight, 0), (attn.in_proj_bias, 0), (attn.out_proj.weight, 1)):
            graphc.to_global(p, placement=P01, sbp=sbp.split(dim))
    return model


def _batches():
    g = torch.Generator().manual_seed(6)
    lengths = torch.tensor([5, 3, 4, 2])
    padded = torch.arange(S)[None, :] >= lengths[:, None]
    return [(torch.randn(BATCH, L, E, generator=g), torch.randn(BATCH, S, E, generator=g), padded,
             torch.randint(0, 3, (BATCH, L), generator=g)) for _ in range(STEPS)]


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "sequence_first"])
def test_masked_and_cross_attention_split_by_heads(batch_first):
    torch.manual_seed(0)
    model = _megatron(Block(batch_first))
    cg = compile_graph(AttnGraph(model, torch.optim.SGD(model.parameters(), lr=0.1)), list(_batches()[0]), 2)
    assert not [n for n in cg.gm.graph.nodes if n.op == "call_module" and "attn" in str(n.target)]
    fallbacks = [n.name for n in cg.gm.graph.nodes if META_SBP in n.meta and n.meta[META_SBP].fallback]
    assert not fallbacks, fallbacks
    comms = [i for i in cg.plans[0].instructions if isinstance(i, Collective)]
    assert {i.kind for i in comms} == {"all_reduce"}, "\n".join(map(str, comms))
    # three attention calls: one all-reduce forward each; backward one for each whose input
    # needs a gradient (the first reads the input x, cross-attention's keys the memory)
    assert len([i for i in comms if i.direction == "F"]) == 3, "\n".join(map(str, comms))
    assert len([i for i in comms if i.direction == "B"]) == 2, "\n".join(map(str, comms))


def _train(rank, world, batch_first, layout):
    torch.manual_seed(0)
    model = Block(batch_first)
    if layout == "tensor":
        _megatron(model)
    else:
        graphc.to_global(model, placement=P01, sbp=sbp.broadcast)
    losses, state = graphc_train(AttnGraph(model, OPTIMIZERS["sgd_momentum"](model.parameters())), _batches(),
                                 feed=feed_split(P01, rank) if layout == "data" else None)
    return {"losses": losses, "state": state}


@pytest.mark.world
@pytest.mark.parametrize("batch_first, layout", ATTENTION_LAYOUTS, ids=ATTENTION_LAYOUT_IDS)
def test_masked_and_cross_attention_match_eager(batch_first, layout):
    torch.manual_seed(0)
    model = Block(batch_first)

    def loss_fn(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    class Eager(nn.Module):  # eager_train calls model(x) with the batch's first item
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, batch):
            return self.model(*batch)

    batches = [((x, memory, padded), y) for x, memory, padded, y in _batches()]
    want_losses, eager_state = eager_train(Eager(), OPTIMIZERS["sgd_momentum"], None, loss_fn, batches, STEPS)
    want_state = {k.removeprefix("model."): v for k, v in eager_state.items()}
    for rank, got in enumerate(run_world(_train, 2, batch_first, layout)):
        assert_same_as_eager(got["losses"], got["state"], want_losses, want_state,
                             f"masked/cross attention (batch_first={batch_first}) {layout} 2, rank {rank}")
