"""Megatron sequence parallelism (config.enable_sequence_parallel; NOTE: Sequence parallel).

Plan level (one process, a world of 2): on a nanoGPT block stack with Megatron's
column/row-parallel Linears, each layer's all-reduces become reduce-scatter/all-gather
pairs moving the same bytes, and nothing falls back to broadcast.
Numerics (local world, every rank a thread): tp2 (and an uneven sequence), data x tensor
on a 2x2 mesh, pipeline x tensor, and examples/hf_llama.py's Llama on tp2 train like
eager PyTorch on the whole batch, float64, tolerance 1e-10 (the oracle of helpers.py);
the activations a rank saves for backward shrink against the same run without sequence
parallelism.
"""
import os
import sys

import pytest
import torch

import graphc
from graphc import sbp
from graphc.meta import META_SBP
from graphc.plan.instructions import AllReduce, Collective
from graphc.runtime.local_world import LocalWorld
from gpt_block_models import BlockStack, TokenLossGraph, megatron, token_loss
from helpers import (assert_same_as_eager, compile_graph, eager_train, feed_split, global_input,
                     graphc_train)
from models import OPTIMIZERS

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

STEPS = 2
BATCH, T, D_IN, CLASSES = 4, 8, 8, 5
P01 = graphc.placement("cpu", [0, 1])


def _batches(batch=BATCH, t=T):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(batch, t, D_IN, generator=g), torch.randint(0, CLASSES, (batch, t), generator=g))
            for _ in range(STEPS)]


def _graph(layers: int, sequence_parallel: bool, make_opt=OPTIMIZERS["sgd_momentum"]):
    torch.manual_seed(0)
    model = megatron(BlockStack(layers=layers), P01)
    graph = TokenLossGraph(model, make_opt(model.parameters()))
    graph.config.enable_sequence_parallel(sequence_parallel)
    return graph


def _layer_collectives(layers: int, sequence_parallel: bool):
    """Rank 0's forward and backward collectives of the boxes inside the blocks."""
    x, y = _batches()[0]
    cg = compile_graph(_graph(layers, sequence_parallel), [x, y], 2)
    assert not [n.name for n in cg.gm.graph.nodes if META_SBP in n.meta and n.meta[META_SBP].fallback]
    comms = [i for i in cg.plans[0].instructions if isinstance(i, Collective)]
    return [(i.direction, i.kind, i.nbytes) for i in comms]


def _per_layer(comms_1, comms_2):
    """What a second layer adds: the collectives of layer 2 minus those of layer 1."""
    extra = list(comms_2)
    for c in comms_1:
        extra.remove(c)
    return sorted(extra)


def test_sequence_parallel_collectives_per_layer():
    plain = _per_layer(_layer_collectives(1, False), _layer_collectives(2, False))
    seq = _per_layer(_layer_collectives(1, True), _layer_collectives(2, True))
    # Megatron: attention and MLP each an all-reduce forward (g) and backward (f) ...
    assert sorted(k for _, k, _ in plain) == ["all_reduce"] * 4, plain
    # ... with sequence parallelism each a reduce-scatter and an all-gather both ways
    assert sorted((d, k) for d, k, _ in seq) == sorted(
        [("F", "reduce_scatter"), ("F", "all_gather"), ("B", "reduce_scatter"), ("B", "all_gather")] * 2), seq
    assert sum(b for _, _, b in seq) == sum(b for _, _, b in plain), (seq, plain)


def test_enable_sequence_parallel_takes_a_bool():
    graph = _graph(1, False)
    with pytest.raises(graphc.GraphcError, match="enable_sequence_parallel expects True or False"):
        graph.config.enable_sequence_parallel("yes")


def _train_tp2(rank):
    out = {}
    for sp in (False, True):
        graph = _graph(2, sp)
        graph.config.set_memory_stats(True)   # graph.last_stats.max_live_bytes
        losses, state = graphc_train(graph, _batches())
        out[sp] = (losses, state, sum(graph.last_stats.max_live_bytes.values()))
    return out


def test_sequence_parallel_tp2_matches_eager():
    results = LocalWorld(2).run(_train_tp2)
    torch.manual_seed(0)
    ref_losses, ref_state = eager_train(BlockStack(layers=2), OPTIMIZERS["sgd_momentum"], None,
                                        token_loss, _batches(), STEPS)
    for rank, res in enumerate(results):
        for sp, (losses, state, _) in res.items():
            assert_same_as_eager(losses, state, ref_losses, ref_state, f"tp2 sp={sp} rank {rank}")
        # each of the 5 layer norms (2 a block, ln_f) saves its [B, T, C] input split: half of
        # it per rank; the column-parallel Linears still save their gathered inputs whole
        saved_plain, saved_seq = res[False][2], res[True][2]
        whole = BATCH * T * 16 * 8
        assert saved_plain - saved_seq >= 5 * whole // 2, (rank, saved_seq, saved_plain)


@pytest.mark.slow   # CI time: tp2 in test_sequence_parallel_tp2_matches_eager
def test_sequence_parallel_uneven_sequence_matches_eager():
    """A sequence of 7 on 2 ranks: shards of 4 and 3 positions (NOTE: Uneven splits)."""
    def train(rank):
        graph = _graph(2, True)
        losses, state = graphc_train(graph, _batches(t=7))
        return losses, state, {i.kind for i in graph.plan.instructions if isinstance(i, Collective)}
    results = LocalWorld(2).run(train)
    torch.manual_seed(0)
    ref_losses, ref_state = eager_train(BlockStack(layers=2), OPTIMIZERS["sgd_momentum"], None,
                                        token_loss, _batches(t=7), STEPS)
    for rank, (losses, state, kinds) in enumerate(results):
        assert_same_as_eager(losses, state, ref_losses, ref_state, f"tp2 sp T=7 rank {rank}")
        assert {"reduce_scatter", "all_gather"} <= kinds, kinds


def _train_2d(rank):
    """Data x tensor on a 2-D mesh: rows split the batch, columns hold Megatron shards and
    split the sequence."""
    mesh = graphc.placement("cpu", [[0, 1], [2, 3]])
    torch.manual_seed(0)
    model = BlockStack(layers=2)
    graphc.to_global(model, placement=mesh, sbp=(sbp.broadcast, sbp.broadcast))
    for block in model.blocks:
        for lin in (block.attn.c_attn, block.mlp.c_fc):
            graphc.to_global(lin, placement=mesh, sbp=(sbp.broadcast, sbp.split(0)))
        for lin in (block.attn.c_proj, block.mlp.c_proj):
            graphc.to_global(lin.weight, placement=mesh, sbp=(sbp.broadcast, sbp.split(1)))
    graph = TokenLossGraph(model, OPTIMIZERS["sgd_momentum"](model.parameters()))
    graph.config.enable_sequence_parallel(True)
    losses, state = graphc_train(graph, _batches(2 * BATCH),
                                 feed=feed_split(mesh, rank, (sbp.split(0), sbp.broadcast)))
    kinds = sorted({i.kind for i in graph.plan.instructions if isinstance(i, Collective)})
    return losses, state, kinds


@pytest.mark.slow   # CI time: tp2 in test_sequence_parallel_tp2_matches_eager
def test_sequence_parallel_data_x_tensor_matches_eager():
    results = LocalWorld(4).run(_train_2d)
    torch.manual_seed(0)
    ref_losses, ref_state = eager_train(BlockStack(layers=2), OPTIMIZERS["sgd_momentum"], None,
                                        token_loss, _batches(2 * BATCH), STEPS)
    for rank, (losses, state, kinds) in enumerate(results):
        assert_same_as_eager(losses, state, ref_losses, ref_state, f"dp2 x tp2 sp rank {rank}")
        assert {"reduce_scatter", "all_gather"} <= set(kinds), kinds


def _megatron_block(block, where):
    graphc.to_global(block, placement=where, sbp=sbp.broadcast)
    for lin in (block.attn.c_attn, block.mlp.c_fc):
        graphc.to_global(lin, placement=where, sbp=sbp.split(0))
    for lin in (block.attn.c_proj, block.mlp.c_proj):
        graphc.to_global(lin.weight, placement=where, sbp=sbp.split(1))


def _train_pp2_tp2(rank):
    """Pipeline x tensor: block 0 (and the input Linear) on ranks 0-1, block 1 and the head on
    ranks 2-3, each stage Megatron-split over its two ranks, two micro-batches."""
    p0, p1 = graphc.placement("cpu", [0, 1]), graphc.placement("cpu", [2, 3])
    torch.manual_seed(0)
    model = BlockStack(layers=2)
    for part, where in ((model.inp, p0), (model.ln_f, p1), (model.head, p1)):
        graphc.to_global(part, placement=where, sbp=sbp.broadcast)
    _megatron_block(model.blocks[0], p0)
    _megatron_block(model.blocks[1], p1)
    graph = TokenLossGraph(model, OPTIMIZERS["sgd_momentum"](model.parameters()))
    for name, stage, where in (("inp", 0, p0), ("ln_f", 1, p1), ("head", 1, p1)):
        getattr(graph.model, name).config.set_stage(stage, where)
    graph.model.blocks[0].config.set_stage(0, p0)
    graph.model.blocks[1].config.set_stage(1, p1)
    graph.config.set_gradient_accumulation_steps(2)
    graph.config.enable_sequence_parallel(True)
    losses, state = graphc_train(graph, _batches())
    kinds = sorted({i.kind for i in graph.plan.instructions if isinstance(i, Collective)})
    return losses, state, kinds


@pytest.mark.slow   # CI time: tp2 in test_sequence_parallel_tp2_matches_eager
def test_sequence_parallel_pipeline_x_tensor_matches_eager():
    results = LocalWorld(4).run(_train_pp2_tp2)
    torch.manual_seed(0)
    ref_losses, ref_state = eager_train(BlockStack(layers=2), OPTIMIZERS["sgd_momentum"], None,
                                        token_loss, _batches(), STEPS)
    for rank, (losses, state, kinds) in enumerate(results):
        # the loss comes back on the last stage's ranks; the full state on every rank
        assert_same_as_eager(losses if rank >= 2 else ref_losses, state, ref_losses, ref_state,
                             f"pp2 x tp2 sp rank {rank}")
        assert {"reduce_scatter", "all_gather"} <= set(kinds), (rank, kinds)


def _llama_tp2(sequence_parallel: bool):
    """examples/hf_llama.py's LlamaForCausalLM on tp2 (as it comes: padded rows, labels=),
    every step checked against eager at 1e-10 (graphc.testing.local_world)."""
    pytest.importorskip("transformers")
    import hf_llama
    from gpt import Layout
    args = type("Args", (), dict(seed=0, embd=32, layers=2, heads=4, block=12))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (4, 12), generator=g)
    mask = (torch.arange(12)[None] < torch.randint(2, 13, (4,), generator=g)[:, None]).long()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    def make():
        model = hf_llama.make_model(64, args)
        graph = hf_llama.LlamaGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), Layout(1, 2, 1), 1)
        graph.config.enable_sequence_parallel(sequence_parallel)
        return graph
    return graphc.testing.local_world(make, lambda rank, step: (batch,), 2, steps=2, check=True)


@pytest.mark.slow   # CI time: the block stack in test_sequence_parallel_tp2_matches_eager
def test_sequence_parallel_hf_llama_tp2_matches_eager():
    runs = {sp: _llama_tp2(sp) for sp in (False, True)}
    for sp, run in runs.items():
        assert run.ok, run.text()
    counts = {sp: sorted((i.direction, i.kind) for i in run.graphs[0].plan.instructions
                         if isinstance(i, Collective)) for sp, run in runs.items()}
    # 2 layers: 4 all-reduces each way become 4 reduce-scatters and 4 all-gathers each way
    assert counts[False] == [("B", "all_reduce")] * 4 + [("F", "all_reduce")] * 4, counts[False]
    layers = [c for c in counts[True] if c[1] in ("reduce_scatter", "all_gather")]
    assert layers == sorted([("F", "reduce_scatter"), ("F", "all_gather"),
                             ("B", "reduce_scatter"), ("B", "all_gather")] * 4), counts[True]
    # the head: the logits' sequence split becomes a row split (not an all-reduce of them)
    head = [c for c in counts[True] if c not in layers]
    assert ("F", "all_to_all") in head and len(head) <= 4, head


def test_sequence_parallel_leaves_data_parallel_alone():
    """Without a split parameter there is no tensor axis: the switch changes no layout."""
    x, y = _batches()[0]

    def layouts(sp: bool):
        torch.manual_seed(0)
        model = BlockStack(layers=1)
        graph = TokenLossGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
        graph.model.config.set_stage(0, P01)
        graph.config.enable_sequence_parallel(sp)
        cg = compile_graph(graph, [global_input(x, P01, sbp.split(0), 0), global_input(y, P01, sbp.split(0), 0)], 2)
        return [(n.name, n.meta[META_SBP].out) for n in cg.gm.graph.nodes if META_SBP in n.meta]
    assert layouts(True) == layouts(False)
