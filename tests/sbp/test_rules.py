"""SBP rules for attention, masking, indexing, casts and sizes, in one process.

Graphs are compiled for 2 ranks without a process group; the local forms of size reads
run on hand-laid-out fx graphs. See docs/sbp.md for the rule table.
"""
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from graphc.meta import META_SBP, META_TENSOR, SbpSignature, TensorMeta
from graphc.passes.localize_ops import localize_ops
from graphc.placement import Broadcast, PartialSum, Split
from helpers import compile_graph, global_input

P01 = graphc.placement("cpu", [0, 1])
MESH = (0, 1)


class FnGraph(graphc.Graph):
    """Forward-only graph of fn(x) on a split(0) input."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def build(self, x):
        return self.fn(x)


def _sigs(fn, shape=(4, 6, 8), x_sbp=sbp.split(0)):
    cg = compile_graph(FnGraph(fn), [global_input(torch.randn(*shape), P01, x_sbp)], 2)
    return {n.name: n.meta[META_SBP] for n in cg.gm.graph.nodes if META_SBP in n.meta}


def test_basic_indexing_keeps_whole_dims_split_and_advanced_indexing_gathers():
    sigs = _sigs(lambda x: x[:, 1:3, None, ..., 0])
    assert sigs["getitem"].out == (Split(0),) and not sigs["getitem"].fallback
    sigs = _sigs(lambda x: x[1:3])  # a slice of the split dim: a conversion first, no fallback
    assert not sigs["getitem"].fallback and sigs["getitem"].out != (Split(0),)
    # two index tensors gather (sbp/tensor_index.py): linear in x, its split rows read as each
    # rank's addend, the result partial, no fallback
    sigs = _sigs(lambda x: x[torch.tensor([0, 2]), torch.tensor([1, 1])])
    assert not sigs["getitem"].fallback and sigs["getitem"].out == (PartialSum(),)
    # one index tensor is a lookup (sbp/routing.py): the split rows read as each rank's
    # addend of the whole, the result partial, no fallback
    sigs = _sigs(lambda x: x[torch.tensor([0, 2])])
    assert not sigs["getitem"].fallback and sigs["getitem"].out == (PartialSum(),)


def test_casts_masks_and_softmax_keep_the_split():
    def fn(x):
        m = torch.tril(torch.ones(6, 8)) == 0
        return x.float().masked_fill(m, float("-inf")).softmax(-1).type_as(x).to(torch.float64)
    sigs = _sigs(fn)
    assert not [k for k, s in sigs.items() if s.fallback]
    assert [k for k, s in sigs.items() if s.out != (Split(0),)] == ["_tensor_constant0"]


def test_argmax_keeps_the_rows_it_does_not_reduce_split():
    """Predictions of a batch split over data ranks (`logits.argmax(-1) == y`) stay split; over
    the split dim itself there is no partial form: the input is split along another dim first."""
    sigs = _sigs(lambda x: (x.argmax(-1), torch.amax(x, 1, keepdim=True)))
    assert sigs["argmax"].out == (Split(0),) and not sigs["argmax"].fallback
    assert sigs["amax"].out == (Split(0),) and not sigs["amax"].fallback
    over_rows = _sigs(lambda x: x.argmax(0))["argmax"]
    assert over_rows.ins[0][1] != (Split(0),) and not over_rows.fallback


def test_attention_splits_batch_or_heads_never_the_sequence():
    def fn(x):  # x [B, H, T, E], split on the sequence dim T
        return F.scaled_dot_product_attention(x, x, x, is_causal=True)
    sdpa = _sigs(fn, (2, 4, 6, 8), sbp.split(2))["scaled_dot_product_attention"]
    assert sdpa.out[0] in (Split(0), Split(1)) and not sdpa.fallback
    assert [need for _, need in sdpa.ins] == [sdpa.out]


def test_attention_splits_grouped_query_heads():
    def fn(x):  # q: 4 heads, k and v: 2 heads, each serving 2 query heads
        kv = x[:, :2]
        return F.scaled_dot_product_attention(x, kv, kv, enable_gqa=True)
    sdpa = _sigs(fn, (2, 4, 6, 8), sbp.split(1))["scaled_dot_product_attention"]
    assert sdpa.out == (Split(1),) and {need for _, need in sdpa.ins} == {(Split(1),)}


def test_batch_norm_called_with_batch_statistics_is_a_fallback():
    def fn(x):
        return F.batch_norm(x, None, None, training=True)
    sigs = _sigs(fn, (4, 6, 8))
    assert sigs["batch_norm"].fallback


def test_size_of_a_split_value_reads_the_global_size():
    gm = fx.symbolic_trace(lambda x: (x.size(0), x.size(), x.shape, x.numel(), x.dim()))
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta[META_TENSOR] = TensorMeta((8, 3), "float64", False)
            node.meta[META_SBP] = SbpSignature(MESH, (Split(0),))
        elif node.op != "output":
            node.meta[META_TENSOR] = None
            node.meta[META_SBP] = SbpSignature(MESH, (Broadcast(),), (("x", (Split(0),)),))
    local = torch.randn(4, 3)  # this rank's rows
    assert localize_ops(gm)(local) == (8, torch.Size([8, 3]), torch.Size([8, 3]), 24, 2)


def test_partial_sum_survives_exact_casts_only():
    """A cast of a sum is the sum of the casts only when the cast is exact (widening): through
    a narrowing one (HF RMSNorm's .to(float32) of a float64 value) the addends would be
    rounded apart, so the value is reduced first; an integer cast of an addend is no addend."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4, bias=False)

        def forward(self, x):
            y = self.fc(x)  # row-parallel: partial_sum (float64)
            return y.double().sum(), y.float().sum(), y.long().sum()

    model = Net()
    graphc.to_global(model.fc.weight, placement=P01, sbp=sbp.split(1))
    graph = FnGraph(model)
    graph.model = model
    graph.fn = lambda x: model(x)
    cg = compile_graph(graph, [torch.randn(4, 8)], 2)
    sigs = {n.name: n.meta[META_SBP] for n in cg.gm.graph.nodes if META_SBP in n.meta}
    assert sigs["linear"].out == (PartialSum(),)
    assert sigs["double"].out == (PartialSum(),)  # float64 -> float64: exact
    assert sigs["float_1"].out != (PartialSum(),)  # float64 -> float32: reduced first
    assert sigs["long"].out == (Broadcast(),)  # an integer cast of an addend is not an addend


def test_expand_keeps_a_split_dim_it_does_not_expand():
    """GQA's repeat_kv (x[:, :, None].expand(b, kv, n_rep, t, d)) on heads split over ranks:
    no fallback gathers the heads (issue 21); the expand's sizes become local (-1)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.kv = nn.Linear(8, 8, bias=False)

        def forward(self, x):
            b, t = x.shape[:2]
            h = self.kv(x).view(b, t, 2, 4).transpose(1, 2)          # [b, heads, t, d]
            h = h[:, :, None, :, :].expand(b, 2, 3, t, 4)            # repeat each head 3 times
            return h.reshape(b, 6, t, 4).sum()

    model = Net()
    graphc.to_global(model.kv.weight, placement=P01, sbp=sbp.split(0))
    graph = FnGraph(model)
    graph.model = model
    graph.fn = lambda x: model(x)
    cg = compile_graph(graph, [torch.randn(2, 5, 8)], 2)
    nodes = {n.name: n for n in cg.gm.graph.nodes}
    exp = nodes["expand"]
    assert not exp.meta[META_SBP].fallback and exp.meta[META_SBP].out == (Split(1),)
    assert -1 in exp.args[1]  # the split heads dim keeps the local size


def test_pad_keeps_a_split_dim_it_does_not_grow():
    """HF's causal-LM loss pads its labels' last dim (F.pad(labels, (0, 1), value=-100)): the
    batch stays split, no fallback gathers it; padding the split dim is a conversion first."""
    sigs = _sigs(lambda x: F.pad(x, (0, 1), value=-100.0))
    assert sigs["pad"].out == (Split(0),) and not sigs["pad"].fallback
    sigs = _sigs(lambda x: F.pad(x, (0, 0, 0, 0, 1, 1)))   # grows dim 0, the split one
    assert sigs["pad"].out != (Split(0),) and not sigs["pad"].fallback
