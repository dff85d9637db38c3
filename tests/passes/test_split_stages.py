"""split_stages: every set of values crossing a stage boundary pairs up, in one process.

See NOTE: Boundary order (graphc/passes/split_stages.py): both sides of a boundary list
its values in the annotated graph's node order, whatever order the receiver uses them in.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import compiler
from graphc.plan.instructions import Recv, Send
from transformer_models import BlockNet, CutGraph, block_batches


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 3)

    def forward(self, h):
        h = h + self.fc2(F.gelu(self.fc1(h)))  # the receiver uses gelu before h
        return self.head(h)


class ResidualGraph(graphc.Graph):
    def __init__(self):
        super().__init__()
        self.m = Residual()
        self.m.fc1.config.set_stage(0, graphc.placement("cpu", ranks=[0]))
        self.m.fc2.config.set_stage(1, graphc.placement("cpu", ranks=[1]))
        self.config.set_gradient_accumulation_steps(2)

    def build(self, x, y):
        loss = F.cross_entropy(self.m(x), y)
        loss.backward()
        return loss


def _assert_boundaries_pair_up(c):
    order = {n.name: i for i, n in enumerate(c.gm.graph.nodes)}
    for prog in c.programs:
        for consumer, sent in prog.send_to.items():
            received = c.programs[consumer].recv_from[prog.stage]
            assert sent == received, f"stage {prog.stage} -> {consumer}: {sent} vs {received}"
            positions = [order[s.name] for s in sent]
            assert positions == sorted(positions), f"not in node order: {sent}"
    for plan in c.plans:  # and so do the plans' payloads, both directions
        for ins in plan.instructions:
            if isinstance(ins, (Send, Recv)):
                assert ins.tensors, f"rank {plan.rank}: empty transfer {ins}"


def test_residual_cut_inside_the_block_pairs_up():
    c = compiler.compile(ResidualGraph(), [torch.randn(4, 8), torch.randint(0, 3, (4,))], 2)
    sent = [s.name for s in c.programs[0].send_to[1]]
    assert sent == ["x", "gelu"]  # production order, though stage 1 reads gelu first
    assert [s.name for s in c.programs[1].recv_from[0]] == sent
    grads = [i for i in c.plans[1].instructions if isinstance(i, Send)]
    assert [s.name for s in grads[0].tensors] == ["gelu"]  # x (an input) needs no gradient
    _assert_boundaries_pair_up(c)


# With sdpa the attention is one op: only a cut between its projections (before k, v or proj)
# sends other values than without it; every other cut sends the same (the sdpa=False case).
_INSIDE_ATTENTION = [BlockNet.LEAVES.index(name) for name in ("block.attn.k", "block.attn.v", "block.attn.proj")]


@pytest.mark.parametrize("sdpa", [False, True])
def test_transformer_block_cut_anywhere_pairs_up(sdpa):
    x, y = block_batches()[0]
    for cut in _INSIDE_ATTENTION if sdpa else range(1, len(BlockNet.LEAVES)):
        _assert_boundaries_pair_up(compiler.compile(CutGraph(BlockNet(sdpa=sdpa), None, (cut,)), [x, y], 2))


@pytest.mark.parametrize("cuts", [(1, 4), (2, 4), (2, 5), (6, 8)])
def test_three_stages_with_skips_over_a_stage_pair_up(cuts):
    x, y = block_batches()[0]
    c = compiler.compile(CutGraph(BlockNet(), None, cuts), [x, y], 3)
    _assert_boundaries_pair_up(c)
    assert 2 in c.programs[0].send_to  # the residual stream skips stage 1


def test_non_contiguous_views_cross_a_boundary():
    x, y = block_batches()[0]
    c = compiler.compile(CutGraph(BlockNet(), None, (3,)), [x, y], 2)  # q on stage 0, k on 1
    prog = c.programs[0]
    outs = dict(zip(prog.outputs, prog.module(*[x[:2] for _ in prog.inputs])))
    assert not outs["transpose"].is_contiguous()  # q split into heads: a transposed view
    assert "transpose" in [s.name for s in c.programs[1].recv_from[0]]
