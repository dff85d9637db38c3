"""Megatron tensor parallelism on nanoGPT-style attention, on real gloo processes.

Plan level (one process, a world of 2): with q/k/v (fused c_attn cut by .split, or three
Linears) and c_fc column-parallel and both c_proj row-parallel, every transformer layer
issues exactly Megatron's collectives: one all-reduce forward and one backward for the
attention and the same for the MLP, and no op falls back to broadcast.
Numerics (2 ranks; and data x tensor on a 2x2 mesh): the same models train like eager
PyTorch on the whole batch, float64, tolerance 1e-10 (the oracle of helpers.py); split
parameters never get a gradient all-reduce.
"""
import pytest
import torch

import graphc
from graphc import sbp
from graphc.meta import META_SBP
from graphc.plan.instructions import AllReduce, Collective
from gpt_block_models import ATTENTION, BlockStack, TokenLossGraph, megatron, token_loss
from helpers import (assert_same_as_eager, compile_graph, eager_train, feed_split, graphc_train,
                     local_model_state, run_world)
from models import OPTIMIZERS

STEPS = 3
BATCH, T, D_IN, CLASSES = 4, 8, 8, 5
P01 = graphc.placement("cpu", [0, 1])
CONFIGS = [(True, "sdpa"), (True, "sdpa_mask"), (True, "manual"), (False, "sdpa")]


def _compile(layers, fused, kind):
    model = megatron(BlockStack(layers=layers, fused=fused, kind=kind), P01)
    graph = TokenLossGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(BATCH, T, D_IN), torch.randint(0, CLASSES, (BATCH, T))
    return compile_graph(graph, [x, y], 2)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_c_attn", "q_k_v"])
@pytest.mark.parametrize("kind", ATTENTION)
def test_megatron_collectives_per_layer(fused, kind):
    for layers in (1, 4):
        cg = _compile(layers, fused, kind)
        fallbacks = [n.name for n in cg.gm.graph.nodes if META_SBP in n.meta and n.meta[META_SBP].fallback]
        assert not fallbacks, fallbacks
        for plan in cg.plans:
            comms = [i for i in plan.instructions if isinstance(i, (Collective, AllReduce))]
            forward = [i for i in comms if isinstance(i, Collective) and i.direction == "F"]
            backward = [i for i in comms if isinstance(i, Collective) and i.direction == "B"]
            # Megatron: attention g (forward) + f (backward), MLP g + f, per layer
            assert len(comms) == 4 * layers, "\n".join(map(str, comms))
            assert {i.kind for i in forward + backward} == {"all_reduce"}
            assert len(forward) == len(backward) == 2 * layers


def _train(rank, world):
    out = {}
    for fused, kind in CONFIGS:
        torch.manual_seed(0)
        model = megatron(BlockStack(fused=fused, kind=kind), P01)
        graph = TokenLossGraph(model, OPTIMIZERS["sgd_momentum"](model.parameters()))
        losses, state = graphc_train(graph, _batches())
        syncs = [t.name for ins in graph.plan.instructions if type(ins) is AllReduce for t in ins.tensors]
        out[(fused, kind)] = {"losses": losses, "state": state, "synced": syncs,
                              "local": local_model_state(model)}
    return out


def _train_2d(rank, world):
    """Data x tensor on a 2-D mesh: rows split the batch, columns hold Megatron shards (a
    fused c_attn stored in pieces on the tensor axis)."""
    mesh = graphc.placement("cpu", [[0, 1], [2, 3]])
    torch.manual_seed(0)
    model = BlockStack(fused=True)
    graphc.to_global(model, placement=mesh, sbp=(sbp.broadcast, sbp.broadcast))
    for block in model.blocks:
        for lin in (block.attn.c_attn, block.mlp.c_fc):
            graphc.to_global(lin, placement=mesh, sbp=(sbp.broadcast, sbp.split(0)))
        for lin in (block.attn.c_proj, block.mlp.c_proj):
            graphc.to_global(lin.weight, placement=mesh, sbp=(sbp.broadcast, sbp.split(1)))
    graph = TokenLossGraph(model, OPTIMIZERS["sgd_momentum"](model.parameters()))
    losses, state = graphc_train(graph, _batches(2 * BATCH),
                                 feed=feed_split(mesh, rank, (sbp.split(0), sbp.broadcast)))
    return {"losses": losses, "state": state}


def _batches(batch=BATCH):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(batch, T, D_IN, generator=g), torch.randint(0, CLASSES, (batch, T), generator=g))
            for _ in range(STEPS)]


@pytest.mark.world
@pytest.mark.slow   # CI time: Megatron attention on tp runs in the local sweep's GPT tp configurations
def test_megatron_attention_matches_eager():
    results = run_world(_train, 2)
    for fused, kind in CONFIGS:
        torch.manual_seed(0)
        ref_losses, ref_state = eager_train(BlockStack(fused=fused, kind=kind), OPTIMIZERS["sgd_momentum"],
                                            None, token_loss, _batches(), STEPS)
        for rank, res in enumerate(results):
            got = res[(fused, kind)]
            what = f"{'fused c_attn' if fused else 'q/k/v'} {kind} rank {rank}"
            assert_same_as_eager(got["losses"], got["state"], ref_losses, ref_state, what)
            assert not [s for s in got["synced"] if "attn" in s or "c_fc" in s], (what, got["synced"])
            if fused:  # rank r holds shard r of each of q, k and v (NOTE: fused pieces)
                w = ref_state["blocks.0.attn.c_attn.weight"].chunk(3)
                local = got["local"]["blocks.0.attn.c_attn.weight"]
                torch.testing.assert_close(local, torch.cat([p.chunk(2)[rank] for p in w]),
                                           atol=1e-10, rtol=1e-10)


@pytest.mark.world
@pytest.mark.slow   # CI time: Megatron attention in test_megatron_attention_matches_eager, data x tensor in test_gpt
def test_data_x_tensor_fused_attention_matches_eager():
    results = run_world(_train_2d, 4)
    torch.manual_seed(0)
    ref_losses, ref_state = eager_train(BlockStack(fused=True), OPTIMIZERS["sgd_momentum"], None,
                                        token_loss, _batches(2 * BATCH), STEPS)
    for rank, got in enumerate(results):
        assert_same_as_eager(got["losses"], got["state"], ref_losses, ref_state,
                             f"data x tensor, fused c_attn, rank {rank}")
