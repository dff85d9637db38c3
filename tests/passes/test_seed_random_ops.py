"""seed_random_ops, one process: which random ops draw alike on every rank and which per shard.

Tensor parallel 2 (Megatron q/k/v and c_proj): the dropout on head-split v and the
attention's dropout_p draw per shard (each rank's coordinate on the split axis); the
dropouts after the row-parallel projection's all-reduce and on the residual stream are
broadcast and draw with no coordinate, alike on every rank. A one-rank graph keeps
eager's global RNG. `seeded` itself: a pure function of (seed, step, micro-batch, node,
shard) that leaves the caller's RNG stream where it was.
"""
import torch
import torch.nn.functional as F

import graphc
from graphc import compiler
from graphc.meta import META_SBP
from graphc.placement import Broadcast
from graphc.ops.random_ops import drawing, seeded
from dropout_models import DropNet, tensor_parallel
from gpt_block_models import TokenLossGraph


def _seeded_nodes(model, world):
    graph = TokenLossGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cg = compiler.compile(graph, [torch.randn(4, 4, 6), torch.randint(0, 5, (4, 4))], world)
    return cg, {n.name: n for n in cg.gm.graph.nodes if n.target is seeded}


def test_replicas_draw_alike_and_shards_their_own():
    cg, nodes = _seeded_nodes(tensor_parallel(DropNet(0.1), graphc.placement("cpu", [0, 1])), 2)
    per_shard = {name for name, n in nodes.items() if n.args[2]}
    alike = {name for name, n in nodes.items() if not n.args[2]}
    assert per_shard == {"dropout", "scaled_dot_product_attention"}, nodes  # v and attention
    assert len(alike) == 2, nodes  # after c_proj's all-reduce, and on the residual
    for name in per_shard:
        assert nodes[name].args[2] == ((0, (0,)), (1, (1,)))
    for name in alike:
        assert all(isinstance(s, Broadcast) for s in nodes[name].meta[META_SBP].out)
    assert "seed_random_ops" in [r.name for r in cg.history]


def test_one_rank_keeps_eager_rng():
    _, nodes = _seeded_nodes(DropNet(0.1), 1)
    assert not nodes


def test_seeded_is_a_pure_function_that_spares_the_callers_stream():
    x = torch.ones(64)
    torch.manual_seed(3)
    before = torch.get_rng_state()

    def mask(step, mb, key="k", coords=()):
        with drawing(11, step, mb):
            return seeded("dropout", key, coords, x, 0.5, True)

    assert torch.equal(mask(0, 0), mask(0, 0))
    assert torch.equal(torch.get_rng_state(), before)
    assert not torch.equal(mask(0, 0), mask(1, 0))
    assert not torch.equal(mask(0, 0), mask(0, 1))
    assert not torch.equal(mask(0, 0), mask(0, 0, "k2"))
    assert not torch.equal(mask(0, 0, coords=((0, (1,)),)), mask(0, 0))  # rank 0 as shard 1
    assert torch.equal(seeded("dropout", "k", (), x, 0.0, True), x)
