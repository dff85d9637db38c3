"""Tied and shared parameters train exactly like eager PyTorch on the whole batch.

A GPT whose token embedding is tied to its LM head (`lm_head.weight = wte.weight`), and a
module called on two stages, on real gloo processes against eager PyTorch in float64
(tolerance 1e-10, helpers.py): pipeline 2 (1F1B and GPipe) and 4, data parallel 2, tensor
parallel 2 (a vocabulary-parallel embedding tied to a vocabulary-parallel head; a broadcast
tie beside Megatron MLPs), pipeline x data and pipeline x tensor (the vocabulary-parallel
tie held split by both stages) on 4 ranks. Every holder's copy of a tied
parameter is bit-identical after training, and every rank's full_state_dict() holds every
name of model.state_dict(), aliases included, with the trained value.
"""
import pytest
import torch
import torch.nn as nn

import graphc
from graphc import sbp
from graphc.plan.instructions import AllReduce, TieAllReduce
from helpers import assert_same_as_eager, eager_train, graphc_train, run_world
from models import OPTIMIZERS
from transformer_models import GPTGraph, SharedGraph, SharedNet, TinyGPT, token_batches, token_loss

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

STEPS = 3


def _ranks(*rs):
    return graphc.placement("cpu", ranks=list(rs))


def _rows(t, k, n):
    return t.chunk(n)[k]


def _megatron(model, where, per_block=None):
    for i, block in enumerate(model.blocks):
        at = per_block[i] if per_block else where
        graphc.to_global(block.mlp.fc1, placement=at, sbp=sbp.split(0))
        graphc.to_global(block.mlp.fc2.weight, placement=at, sbp=sbp.split(1))


# name -> (world, optimizer, build (model, opt, rank) -> (graph, feed), the tied copies' holders)
def _pipeline(p, schedule):
    def make(model, opt, rank):
        return GPTGraph(model, opt, [_ranks(r) for r in range(p)], 2, schedule), lambda x, y: (x, y)
    return make


def _data(model, opt, rank):
    where = _ranks(0, 1)
    graphc.to_global(model, placement=where, sbp=sbp.broadcast)
    feed = lambda x, y: tuple(graphc.to_global(_rows(t, rank, 2), placement=where, sbp=sbp.split(0))  # noqa: E731
                              for t in (x, y))
    return GPTGraph(model, opt, (), 2), feed


def _tensor_vocab(model, opt, rank):
    where = _ranks(0, 1)
    graphc.to_global(model, placement=where, sbp=sbp.broadcast)
    graphc.to_global(model.wte.weight, placement=where, sbp=sbp.split(0))  # and so lm_head's
    _megatron(model, where)
    return GPTGraph(model, opt, (), 2), lambda x, y: (x, y)


def _tensor_broadcast_tie(model, opt, rank):
    where = _ranks(0, 1)
    graphc.to_global(model, placement=where, sbp=sbp.broadcast)
    _megatron(model, where)
    return GPTGraph(model, opt, (), 2), lambda x, y: (x, y)


def _pipeline_x_data(model, opt, rank):
    p0, p1 = _ranks(0, 1), _ranks(2, 3)
    k = rank % 2
    feed = lambda x, y: (graphc.to_global(_rows(x, k, 2), placement=p0, sbp=sbp.split(0)),  # noqa: E731
                         graphc.to_global(_rows(y, k, 2), placement=p1, sbp=sbp.split(0)))
    return GPTGraph(model, opt, [p0, p1], 1), feed


def _pipeline_x_tensor(model, opt, rank):
    """A vocabulary-parallel tie across stages: the table split(0) on both 2-rank stages."""
    p0, p1 = _ranks(0, 1), _ranks(2, 3)
    for where, modules in ((p0, (model.wte, model.wpe, model.blocks[0])), (p1, (model.blocks[1], model.ln_f))):
        for m in modules:
            graphc.to_global(m, placement=where, sbp=sbp.broadcast)
    graphc.to_global(model.wte.weight, placement=p0, sbp=sbp.split(0))  # held split by both stages
    _megatron(model, None, [p0, p1])
    return GPTGraph(model, opt, [p0, p1], 2), lambda x, y: (x, y)


CONFIGS = {
    2: {"pp2_1f1b": ("adam", _pipeline(2, "1f1b"), (0, 1)),
        "pp2_gpipe": ("sgd_momentum", _pipeline(2, "gpipe"), (0, 1)),
        "dp2": ("adam", _data, ()),
        "tp2_vocab_parallel_tie": ("sgd_momentum", _tensor_vocab, ()),
        "tp2_broadcast_tie": ("adam", _tensor_broadcast_tie, ())},
    4: {"pp4_1f1b": ("adam", _pipeline(4, "1f1b"), (0, 3)),
        "pp2_x_dp2": ("sgd_momentum", _pipeline_x_data, (0, 1, 2, 3)),
        "pp2_x_tp2_vocab_parallel_tie": ("adam", _pipeline_x_tensor, (0, 2))},
}


def _layers(name: str) -> int:
    return 4 if name.startswith("pp4") else 2


def _train(rank, world):
    out = {}
    for name, (opt_name, make, _) in CONFIGS[world].items():
        torch.manual_seed(0)
        model = TinyGPT(layers=_layers(name))
        graph, feed = make(model, OPTIMIZERS[opt_name](model.parameters()), rank)
        losses, state = graphc_train(graph, token_batches(STEPS), feed=feed)
        out[name] = {"losses": losses, "state": state,
                     "local_tied": model.wte.weight.detach().clone(),
                     "ties": [str(i) for i in graph.plan.instructions if isinstance(i, TieAllReduce)],
                     "synced": [t.name for i in graph.plan.instructions if type(i) is AllReduce
                                for t in i.tensors]}
    if world == 2:
        torch.manual_seed(0)
        model = SharedNet()
        graph = SharedGraph(model, OPTIMIZERS["adam"](model.parameters()))
        losses, state = graphc_train(graph, _shared_batches())
        out["shared_module_pp2"] = {"losses": losses, "state": state,
                                    "local_tied": model.shared.weight.detach().clone(),
                                    "ties": [str(i) for i in graph.plan.instructions
                                             if isinstance(i, TieAllReduce)]}
    return out


def _shared_batches():
    g = torch.Generator().manual_seed(6)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(STEPS)]


def _check(results, name, ref, holders):
    for rank, res in enumerate(results):
        got = res[name]
        what = f"{name} rank {rank}"
        # ranks outside the loss's stage return no loss; every rank's full state dict matches
        assert_same_as_eager(got["losses"], got["state"], ref[0] if got["losses"] else [], ref[1], what)
    for r in holders[1:]:  # every holder's copy is bit-identical
        torch.testing.assert_close(results[r][name]["local_tied"], results[holders[0]][name]["local_tied"],
                                   atol=0, rtol=0, msg=lambda m: f"{name}: copies differ on rank {r}\n{m}")
    if len(set(holders)) > 1:
        assert results[holders[0]][name]["ties"], f"{name}: no tie collective in the plan"


# CI time: ties run by default in tests/examples/test_gpt.py (pipeline 2, the tied GPT) and
# test_schedules_numerics (a tie across chunks)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_tied_parameters_match_eager(world):
    results = run_world(_train, world)
    for name, (opt_name, _, holders) in CONFIGS[world].items():
        torch.manual_seed(0)
        ref = eager_train(TinyGPT(layers=_layers(name)), OPTIMIZERS[opt_name], None, token_loss,
                          token_batches(STEPS), STEPS)
        assert {"wte.weight", "lm_head.weight"} <= set(ref[1])
        _check(results, name, ref, holders)
    if world == 2:
        torch.manual_seed(0)
        ref = eager_train(SharedNet(), OPTIMIZERS["adam"], None, nn.CrossEntropyLoss(),
                          _shared_batches(), STEPS)
        assert {"shared.weight", "s0.shared.weight", "s1.shared.weight"} <= set(ref[1])
        _check(results, "shared_module_pp2", ref, (0, 1))
