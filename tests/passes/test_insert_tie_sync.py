"""Tied and shared parameters at plan level, in one process (see NOTE: Tied parameters).

annotate_stages gives each stage that uses a parameter its own read of it (and each call
of a shared module its caller's stage); insert_tie_sync sums the copies' gradients with
one TieAllReduce among the holders; gradient sync and GraphState decide per parameter
object, not per name.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import compiler, sbp
from graphc.errors import GraphcError
from graphc.meta import META_GRAD_PARTIAL, META_STAGE
from graphc.plan.instructions import (AllReduce, OptimizerStep, Send, TieAllReduce, instruction_from_json,
                                      parse_instruction)
from graphc.plan.plan import ExecutionPlan
from graphc.checkpoint.graph_state import GraphState
from transformer_models import GPTGraph, SharedGraph, SharedNet, TinyGPT, token_batches

IDX, TARGETS = token_batches(1)[0]


def _ranks(*rs):
    return graphc.placement("cpu", ranks=list(rs))


def _ties(plan):
    return [i for i in plan.instructions if isinstance(i, TieAllReduce)]


@pytest.mark.parametrize("p", [2, 4])
def test_tied_embedding_and_head_are_summed_among_their_stages(p):
    c = compiler.compile(GPTGraph(TinyGPT(layers=p), None, [_ranks(r) for r in range(p)]),
                         [IDX, TARGETS], p)
    first, last = _ties(c.plans[0]), _ties(c.plans[p - 1])
    assert len(first) == 1 and first == last  # equal across ranks: one collective
    assert first[0].ranks == (0, p - 1) and [t.name for t in first[0].tensors] == ["model.wte.weight"]
    assert (first[0].params, last[0].params) == (("model.wte.weight",), ("model.lm_head.weight",))
    for r in range(1, p - 1):
        assert not _ties(c.plans[r])  # the middle stages do not hold it
    # after the last backward, right before the optimizer step
    assert isinstance(c.plans[0].instructions[c.plans[0].instructions.index(first[0]) + 1], OptimizerStep)
    # it prints and parses back, and round-trips through JSON, own names included
    again = parse_instruction(str(last[0]))
    assert again == last[0] and again.params == last[0].params
    assert instruction_from_json(last[0].to_json()).params == last[0].params
    assert ExecutionPlan.from_json(c.plans[p - 1].to_json()).instructions == c.plans[p - 1].instructions


def test_a_module_called_on_two_stages_runs_on_each_callers_stage():
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    c = compiler.compile(SharedGraph(SharedNet(), None), [x, y], 2)
    calls = [n for n in c.gm.graph.nodes if n.op == "call_module" and n.target.endswith("shared")]
    assert sorted(n.meta[META_STAGE] for n in calls) == [0, 1]
    tie = _ties(c.plans[0])
    assert sorted(t.name for t in tie[0].tensors) == ["model.shared.bias", "model.shared.weight"]
    assert tie == _ties(c.plans[1])


class HeadReadsEmbedding(nn.Module):
    """The LM head written as F.linear on the embedding's weight: a get_attr on stage 1."""

    def __init__(self, vocab=16):
        super().__init__()
        self.wte, self.body = nn.Embedding(vocab, 8), nn.Linear(8, 8)

    def forward(self, idx):
        return F.linear(self.body(self.wte(idx)), self.wte.weight)


class HeadGraph(graphc.Graph):
    def __init__(self, model, stages=(_ranks(0), _ranks(1))):
        super().__init__()
        self.model = model
        self.model.wte.config.set_stage(0, stages[0])
        self.model.body.config.set_stage(1, stages[1])
        self.config.set_gradient_accumulation_steps(2)

    def build(self, idx, targets):
        loss = F.cross_entropy(self.model(idx).flatten(0, 1), targets.flatten())
        loss.backward()
        return loss


def test_a_parameter_read_on_a_later_stage_is_held_there_not_sent():
    c = compiler.compile(HeadGraph(HeadReadsEmbedding()), [IDX, TARGETS], 2)
    # stage 0 calls the embedding module; stage 1 reads the weight itself
    reads = [n for n in c.gm.graph.nodes if n.op == "get_attr" and n.target == "model.wte.weight"]
    assert [n.meta[META_STAGE] for n in reads] == [1]
    sent = [t.name for plan in c.plans for i in plan.instructions if isinstance(i, Send) for t in i.tensors]
    assert sent and not [s for s in sent if "weight" in s], sent  # only activations travel
    assert [t.name for t in _ties(c.plans[1])[0].tensors] == ["model.wte.weight"]


def test_tied_stages_of_different_sizes_are_refused():
    with pytest.raises(GraphcError, match=r"(?s)used on stages \[0, 1\].*Fix: give the stages"):
        compiler.compile(HeadGraph(HeadReadsEmbedding(), (_ranks(0, 1), _ranks(2))), [IDX, TARGETS], 3)


def test_tensor_parallel_tie_syncs_the_gradient_per_parameter_not_per_name():
    """Both names of the tied weight share one .grad: partial only if every read is."""
    where = _ranks(0, 1)
    model = graphc.to_global(TinyGPT(), placement=where, sbp=sbp.broadcast)
    for block in model.blocks:
        graphc.to_global(block.mlp.fc1, placement=where, sbp=sbp.split(0))
        graphc.to_global(block.mlp.fc2.weight, placement=where, sbp=sbp.split(1))
    c = compiler.compile(GPTGraph(model, None), [IDX, TARGETS], 2)
    partial = {n.meta[META_GRAD_PARTIAL] for n in c.gm.graph.nodes
               if n.op == "get_attr" and n.target in ("model.wte.weight", "model.lm_head.weight")}
    assert len(partial) == 1, partial
    synced = [t.name for i in c.plans[0].instructions if type(i) is AllReduce for t in i.tensors]
    assert len([s for s in synced if s in ("model.wte.weight", "model.lm_head.weight")]) <= 1


def test_graph_state_holds_every_name_of_a_tied_parameter():
    model = TinyGPT()
    graph = GPTGraph(model, None, [_ranks(0), _ranks(1)])
    c = compiler.compile(graph, [IDX, TARGETS], 2)
    for rank in (0, 1):
        state = GraphState(graph._root, c, rank, None, None)
        assert state.holders["model.wte.weight"] == state.holders["model.lm_head.weight"] == (0, 1)
        assert {"model.wte.weight", "model.lm_head.weight"} <= set(state.local_keys)
    full = state.full_state_dict()  # no process group: this rank's values, every name
    assert list(full) == list(graph._root.state_dict())
    assert full["model.lm_head.weight"] is full["model.wte.weight"]


def test_a_vocabulary_parallel_tie_across_stages_sums_shard_with_shard():
    model = TinyGPT()
    p0, p1 = _ranks(0, 1), _ranks(2, 3)
    graphc.to_global(model.wte.weight, placement=p0, sbp=sbp.split(0))  # also the head's weight
    c = compiler.compile(GPTGraph(model, None, [p0, p1]), [IDX, TARGETS], 4)
    ties = {r: _ties(c.plans[r]) for r in range(4)}
    assert [t.ranks for t in ties[0]] == [(0, 2)] and [t.ranks for t in ties[1]] == [(1, 3)]
    assert ties[0] == ties[2] and ties[1] == ties[3]
    assert ties[0][0].tensors[0].shape == (8, 8)  # this rank's shard of the [16, 8] table


def test_an_uneven_vocabulary_parallel_tie_sums_each_replicas_shard():
    """15 rows over 2 ranks: replica 0 holds 8, replica 1 seven (NOTE: Uneven splits)."""
    model = HeadReadsEmbedding(vocab=15)
    p0, p1 = _ranks(0, 1), _ranks(2, 3)
    graphc.to_global(model.wte.weight, placement=p0, sbp=sbp.split(0))
    c = compiler.compile(HeadGraph(model, (p0, p1)), [IDX, TARGETS], 4)
    ties = {r: _ties(c.plans[r]) for r in range(4)}
    assert ties[0] == ties[2] and ties[1] == ties[3]
    assert ties[0][0].tensors[0].shape == (8, 8) and ties[1][0].tensors[0].shape == (7, 8)
