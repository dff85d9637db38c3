"""torch.nn's own TransformerEncoder and TransformerDecoder, as users build them, against eager.

fx keeps torch.nn modules whole; graphc traces these layers through (NOTE: Composite torch
layers, graphc/passes/build_tracer.py), so their MultiheadAttention splits by heads (NOTE:
MultiheadAttention by heads) and their Linears take declared layouts. The model: an encoder
called with a causal mask (no is_causal, as most code does) and a key padding mask, a
decoder cross-attending to it with the memory's padding mask, a head; dropout 0 (eager's
masks are not graphc's). Plan: on tensor 2 (Megatron's layout on every attention and
feed-forward) no fallback, all-reduces only; on data 2 no collective but the loss's.
Numerics: tensor 2 (batch- and sequence-first) and data 2 on gloo, and an eval-mode call
(eager takes its inference fast path) in one process, equal eager in float64 within 1e-10.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from graphc.meta import META_SBP
from graphc.plan.instructions import Collective, OutputAllReduce
from helpers import (ATTENTION_LAYOUT_IDS, ATTENTION_LAYOUTS, assert_close, assert_same_as_eager, compile_graph,
                     eager_train, feed_split, global_input, graphc_train, run_world)
from models import OPTIMIZERS

STEPS, BATCH, L, T, E, HEADS, FF, CLASSES = 3, 4, 6, 5, 16, 4, 32, 3
P01 = graphc.placement("cpu", [0, 1])


class Seq2Seq(nn.Module):
    def __init__(self, batch_first=True):
        super().__init__()
        self.batch_first = batch_first
        layer = dict(d_model=E, nhead=HEADS, dim_feedforward=FF, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(**layer), 2, enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(**layer), 1)
        self.head = nn.Linear(E, CLASSES)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(L))

    def forward(self, src, tgt, padded):
        if not self.batch_first:
            src, tgt = src.transpose(0, 1), tgt.transpose(0, 1)
        memory = self.encoder(src, mask=self.causal, src_key_padding_mask=padded)
        out = self.decoder(tgt, memory, memory_key_padding_mask=padded)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return self.head(out)


class Train(graphc.Graph):
    def __init__(self, model, opt=None):
        super().__init__()
        self.model = model
        self.learning = opt is not None
        if opt is not None:
            self.add_optimizer(opt)

    def build(self, src, tgt, padded, y):
        out = self.model(src, tgt, padded)
        if not self.learning:
            return out
        loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
        loss.backward()
        return loss


def megatron(model):
    graphc.to_global(model, placement=P01, sbp=sbp.broadcast)
    layers = list(model.encoder.layers) + list(model.decoder.layers)
    attentions = [l.self_attn for l in layers] + [l.multihead_attn for l in model.decoder.layers]
    for attn in attentions:
        for p, dim in ((attn.in_proj_weight, 0), (attn.in_proj_bias, 0), (attn.out_proj.weight, 1)):
            graphc.to_global(p, placement=P01, sbp=sbp.split(dim))
    for l in layers:
        for p, dim in ((l.linear1.weight, 0), (l.linear1.bias, 0), (l.linear2.weight, 1)):
            graphc.to_global(p, placement=P01, sbp=sbp.split(dim))
    return model


def _batches():
    g = torch.Generator().manual_seed(8)
    padded = torch.arange(L)[None, :] >= torch.tensor([6, 4, 5, 3])[:, None]
    return [(torch.randn(BATCH, L, E, generator=g), torch.randn(BATCH, T, E, generator=g), padded,
             torch.randint(0, CLASSES, (BATCH, T), generator=g)) for _ in range(STEPS)]


def _collectives(cg):
    fallbacks = [n.name for n in cg.gm.graph.nodes if META_SBP in n.meta and n.meta[META_SBP].fallback]
    assert not fallbacks, fallbacks
    assert not [n.target for n in cg.gm.graph.nodes if n.op == "call_module" and "attn" in str(n.target)]
    return [i for i in cg.plans[0].instructions if isinstance(i, Collective)]


def test_tensor_parallel_plan_has_no_fallback():
    torch.manual_seed(0)
    model = megatron(Seq2Seq())
    comms = _collectives(compile_graph(Train(model, torch.optim.SGD(model.parameters(), lr=0.1)),
                                       list(_batches()[0]), 2))
    assert {i.kind for i in comms} == {"all_reduce"}, "\n".join(map(str, comms))
    # Megatron's g per attention and feed-forward: 2 encoder layers x 2, the decoder's 3
    assert len([i for i in comms if i.direction == "F"]) == 7, "\n".join(map(str, comms))


def test_data_parallel_plan_keeps_the_batch_split():
    torch.manual_seed(0)
    model = graphc.to_global(Seq2Seq(), placement=P01, sbp=sbp.broadcast)
    inputs = [global_input(t, P01, sbp.split(0)) for t in _batches()[0]]
    cg = compile_graph(Train(model, torch.optim.SGD(model.parameters(), lr=0.1)), inputs, 2)
    comms = _collectives(cg)
    assert not comms, "\n".join(map(str, comms))   # no collective inside the stage program
    sums = [i for i in cg.plans[0].instructions if isinstance(i, OutputAllReduce)]
    assert len(sums) == 1   # the loss's mean: summed once per step


def test_eval_call_equals_eager_inference():
    torch.manual_seed(0)
    model = Seq2Seq().eval()
    src, tgt, padded, _ = _batches()[0]
    with torch.no_grad():
        want = model(src, tgt, padded)  # eager's inference fast path
    got = Train(model)(src, tgt, padded, torch.zeros(BATCH, T, dtype=torch.long)).to_local()
    assert_close(got, want, "nn.Transformer layers in eval mode")


class _Eager(nn.Module):
    """eager_train calls model(x): the batch's inputs as one tuple."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, inputs):
        return self.model(*inputs)


def _train(rank, world, batch_first, layout):
    torch.manual_seed(0)
    model = Seq2Seq(batch_first)
    if layout == "tensor":
        megatron(model)
    else:
        graphc.to_global(model, placement=P01, sbp=sbp.broadcast)
    losses, state = graphc_train(Train(model, OPTIMIZERS["sgd_momentum"](model.parameters())), _batches(),
                                 feed=feed_split(P01, rank) if layout == "data" else None)
    return {"losses": losses, "state": state}


@pytest.mark.world
@pytest.mark.parametrize("batch_first, layout", ATTENTION_LAYOUTS, ids=ATTENTION_LAYOUT_IDS)
def test_nn_transformer_matches_eager(batch_first, layout):
    torch.manual_seed(0)
    model = _Eager(Seq2Seq(batch_first))
    batches = [((src, tgt, padded), y) for src, tgt, padded, y in _batches()]
    want_losses, state = eager_train(model, OPTIMIZERS["sgd_momentum"], None,
                                     lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()), batches, STEPS)
    want_state = {k.removeprefix("model."): v for k, v in state.items()}
    for rank, got in enumerate(run_world(_train, 2, batch_first, layout)):
        assert_same_as_eager(got["losses"], got["state"], want_losses, want_state,
                             f"nn.Transformer layers (batch_first={batch_first}) {layout} 2, rank {rank}")
