"""Uneven splits in one process: shard sizes, rules, boxing shapes and per-rank plan shapes.

See docs/sbp.md, NOTE: Uneven splits. Multi-rank numerics: tests/runtime/test_uneven_splits.py
and tests/runtime/test_boxing.py (the 5 x 3 shape).
"""
import os
import sys

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import graphc
from graphc import sbp
from graphc.meta import META_SBP, META_TENSOR, TensorMeta
from graphc.placement import Broadcast, PartialSum, Split
from graphc.plan.instructions import AllReduce, Recv, Send
from graphc.ops.conversions import box, shapes_only
from graphc.sbp.layout import (chunk_sizes, is_even, local_component, local_shape, place_shard,
                               shard_slices, split_extent)
from graphc.sbp.local_ops import reshape_keeping
from graphc.sbp.rules import RuleCtx, rule_for
from helpers import compile_graph, global_input

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from test_boxing import LAYOUTS, BoxingGraph, Model, _tensors  # noqa: E402

B, P = Broadcast(), PartialSum()


@pytest.mark.parametrize("size,n", [(3, 2), (10, 4), (9, 4), (5, 4), (8, 2), (1, 3)])
def test_shards_are_torch_chunks_padded_with_empty_ones(size, n):
    """DTensor's Shard convention: torch.chunk's pieces, then empty shards up to n."""
    pieces = [c.shape[0] for c in torch.arange(size).chunk(n)]
    assert chunk_sizes(size, n) == tuple(pieces + [0] * (n - len(pieces)))


def test_is_even_read_off_the_mesh_shape_is_every_ranks_shard_alike():
    """is_even divides per axis instead of comparing every rank's shard (a stage's mesh has
    thousands of ranks at scale): the same answer on 1-D and 2-D meshes, nested splits."""
    meshes = [(0, 1, 2), ((0, 1), (2, 3)), ((0, 1, 2), (3, 4, 5)), ((0, 1), (2, 3), (4, 5))]
    layouts = [(Split(0),), (B,), (Split(1),), (Split(0), Split(0)), (Split(0), Split(1)),
               (B, Split(0)), (Split(1), P), (Split(0), B)]
    checked = 0
    for mesh in meshes:
        flat = [r for row in mesh for r in row] if isinstance(mesh[0], tuple) else list(mesh)
        axes = 2 if isinstance(mesh[0], tuple) else 1
        for sbp_ in (lay for lay in layouts if len(lay) == axes):
            for shape in [(a, b) for a in range(0, 13) for b in (1, 2, 3, 6)]:
                every = len({local_shape(shape, sbp_, mesh, r) for r in flat}) == 1
                assert is_even(shape, sbp_, mesh) == every, (mesh, sbp_, shape)
                checked += 1
    assert checked > 900


def test_local_shapes_and_slices_differ_by_rank():
    mesh = (0, 1, 2, 3)
    assert [local_shape((10, 5), (Split(0),), mesh, r) for r in mesh] == [(3, 5)] * 3 + [(1, 5)]
    assert local_shape((10, 5), (Split(0),), mesh) == (3, 5)   # no rank: the first, largest
    assert shard_slices((10, 5), (Split(0),), mesh, 3) == (slice(9, 10), slice(0, 5))
    assert not is_even((10, 5), (Split(0),), mesh) and is_even((8, 5), (Split(0),), mesh)
    full = torch.arange(30.).view(10, 3)
    back = torch.zeros(10, 3)
    for r in mesh:
        place_shard(back, local_component(full, (Split(0),), mesh, r), (Split(0),), mesh, r)
    assert torch.equal(back, full)


def test_two_axes_on_one_dim_cut_the_outer_shard():
    """7 rows on a 2 x 2 mesh: axis 0 cuts 4 and 3, axis 1 cuts those into 2+2 and 2+1."""
    mesh, both = ((0, 1), (2, 3)), (Split(0), Split(0))
    assert [local_shape((7, 2), both, mesh, r)[0] for r in range(4)] == [2, 2, 2, 1]
    assert split_extent((7, 2), both, mesh, 1, 2) == 3      # what axis 1 cuts on row 1
    assert split_extent((7, 2), both, mesh, 0, 3) == 7
    full = torch.arange(14).view(7, 2)
    pieces = [local_component(full, both, mesh, r) for r in range(4)]
    assert torch.equal(torch.cat(pieces), full)


# -- boxing shapes: each rank's output and gradient, without a process group ----------------
CASES = [  # kind, src, dst: on [5, 3] over ranks (0, 1), rank 0 holds 3 rows / 2 columns
    ("all_gather", Split(0), B), ("all_gather", Split(1), B), ("reduce_scatter", P, Split(0)),
    ("all_to_all", Split(0), Split(1)), ("all_to_all", Split(1), Split(0)),
    ("slice", B, Split(1)), ("split_partial", Split(0), P)]


@pytest.mark.parametrize("kind,src,dst", CASES)
def test_boxes_give_each_rank_its_shard_shape(kind, src, dst):
    mesh, shape = (0, 1), (5, 3)
    src_dim = src.dim if isinstance(src, Split) else -1
    dst_dim = dst.dim if isinstance(dst, Split) else -1
    extents = (shape[src_dim],) if src_dim >= 0 else ()
    for rank in mesh:
        x = torch.zeros(local_shape(shape, (src,), mesh, rank), requires_grad=True)
        with shapes_only(rank):
            y = box(x, kind, (mesh,), src_dim, dst_dim, extents)
            y.sum().backward()
        assert tuple(y.shape) == local_shape(shape, (dst,), mesh, rank), (kind, rank)
        assert x.grad.shape == x.shape, (kind, rank)


def test_reshape_keeps_an_uneven_dim_and_gathers_one_it_would_merge():
    class FnGraph(graphc.Graph):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def build(self, x):
            return self.fn(x)
    where = graphc.placement("cpu", [0, 1])

    def sigs(fn):
        cg = compile_graph(FnGraph(fn), [global_input(torch.randn(5, 6), where, sbp.split(0))], 2)
        return {n.name: (n.target, n.meta[META_SBP]) for n in cg.gm.graph.nodes if META_SBP in n.meta}
    kept = sigs(lambda x: x.view(5, 2, 3))["view"]
    assert kept[0] is reshape_keeping and kept[1].out == (Split(0),)
    merged = sigs(lambda x: x.reshape(30))["reshape"]      # 3 + 2 rows are not 15 + 15
    assert merged[1].out != (Split(0),)
    x = torch.arange(18.).view(3, 6)                       # rank 0's rows at run time
    assert reshape_keeping(x, (3, 2, 3), ((0, 0),)).shape == (3, 2, 3)
    assert reshape_keeping(x[:2], (3, 2, 3), ((0, 0),)).shape == (2, 2, 3)


def _candidates(target, shapes, out, method=False, n=2):
    """The rule's (input SBPs, output SBP) for one node on hand-made shapes."""
    g = fx.Graph()
    ins = []
    for i, shape in enumerate(shapes):
        ins.append(g.placeholder(f"a{i}"))
        ins[-1].meta[META_TENSOR] = TensorMeta(shape, "float64", True)
    args = tuple(ins) + ((out,) if method else ())
    node = g.call_method(target, args) if method else g.call_function(target, args)
    node.meta[META_TENSOR] = TensorMeta(out, "float64", True)
    found = rule_for(node)(RuleCtx(node, n, {a: B for a in ins}))
    return {(tuple(req[a] for a in ins), o) for req, o in found}


def test_rules_split_uneven_dims_except_where_shards_must_be_equal():
    linear = _candidates(F.linear, [(5, 4), (3, 4)], (5, 3))      # 5 rows, 3 outputs over 2
    assert ((Split(0), B), Split(0)) in linear and ((B, Split(0)), Split(1)) in linear
    kept = _candidates("view", [(5, 6)], (5, 2, 3), method=True)
    assert ((Split(0),), Split(0)) in kept
    merged = _candidates("view", [(5, 6)], (30,), method=True)    # 3 + 2 rows: not 15 + 15
    assert not any(isinstance(o, Split) for _, o in merged)
    assert ((Split(0),), Split(0)) in _candidates("view", [(6, 5)], (30,), method=True)
    one = _candidates(F.linear, [(1, 4), (1, 4)], (1, 1))            # one row, one output
    assert {o for _, o in one} == {P}                               # only the contraction


# -- plans: a transfer carries its sender's shard, a bucket its group's ---------------------
def test_transfers_between_stages_carry_each_ranks_shard():
    """[5, 3] split(0) from ranks [0, 1] to [2, 3]: 3 rows 0 -> 2, 2 rows 1 -> 3, gradients back
    alike; verify_plans (run by compile) pairs every send with its receive."""
    w, c = _tensors((5, 3))
    p01, p23 = graphc.placement("cpu", [0, 1]), graphc.placement("cpu", [2, 3])
    graph = BoxingGraph(Model(w, c), LAYOUTS["S0"], LAYOUTS["S0"], p01, p23)
    cg = compile_graph(graph, [torch.ones(5, 3)], 4)
    moved = {(p.rank, type(ins).__name__, ins.direction): ins.tensors[0].shape
             for p in cg.plans for ins in p.instructions if isinstance(ins, (Send, Recv))}
    assert moved[(0, "Send", "F")] == moved[(2, "Recv", "F")] == (3, 3)
    assert moved[(1, "Send", "F")] == moved[(3, "Recv", "F")] == (2, 3)
    assert moved[(3, "Send", "B")] == moved[(1, "Recv", "B")] == (2, 3)


def test_gradient_buckets_hold_their_groups_shard():
    """On a 2 x 2 mesh a weight split(0) over axis 1 (3 rows: 2 + 1) and broadcast over the
    data axis 0 is all-reduced down each column, in that column's shape."""
    mesh = graphc.placement("cpu", [[0, 1], [2, 3]])

    class Data(graphc.Graph):
        def __init__(self, model):
            super().__init__()
            self.model = model
            self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

        def build(self, x):
            loss = self.model(x).sum()
            loss.backward()
            return loss
    model = torch.nn.Linear(4, 3, bias=False)
    graphc.to_global(model.weight, placement=mesh, sbp=(sbp.broadcast, sbp.split(0)))
    cg = compile_graph(Data(model), [global_input(torch.randn(4, 4), mesh, (sbp.split(0), sbp.broadcast))], 4)
    shapes = {p.rank: [t.shape for ins in p.instructions if type(ins) is AllReduce
                       for t in ins.tensors] for p in cg.plans}
    assert shapes == {0: [(2, 4)], 2: [(2, 4)], 1: [(1, 4)], 3: [(1, 4)]}
