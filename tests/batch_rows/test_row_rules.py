"""Rows rules (graphc/rows/rules.py) for ops that keep the batch's rows apart along other
dims (issue 19, root cause 2; issue 21): each in a tiny build() at accumulation 2, in one
process. Where the op keeps rows, the batch inputs are split and two SGD steps equal eager
PyTorch on the whole batch in float64 (1e-10, helpers.assert_close); where the same op
works along the batch dim, compiling is a GraphcError naming the op.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc.compiler import compile as compile_graph
from graphc.meta import META_BATCHED
from helpers import assert_close

B, T, D, C, E, K = 8, 3, 6, 5, 4, 2  # batch, tokens, features, classes, experts, experts per token


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(D, D)
        self.table = nn.Parameter(torch.randn(C, D))
        self.router = nn.Linear(D, E)
        self.experts = nn.Parameter(torch.randn(E, D, D) / D ** 0.5)
        self.bag = nn.EmbeddingBag(C, D, mode="mean")


class OpGraph(graphc.Graph):
    """build() is `fn(net, *inputs)`, a scalar loss."""

    def __init__(self, net, fn, accumulation=2):
        super().__init__()
        self.net, self.fn = net, fn
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(torch.optim.SGD(net.parameters(), lr=0.1))

    def build(self, *inputs):
        loss = self.fn(self.net, *inputs)
        loss.backward()
        return loss


def _inputs():
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(B, D, generator=g), "y": torch.randint(0, C, (B,), generator=g),
            "ids": torch.randint(0, C, (B, T), generator=g), "xs": torch.randn(B, T, D, generator=g),
            "mask": torch.rand(B, generator=g) > 0.5, "k": torch.randint(0, D, (B, 2), generator=g)}


def _equal_to_eager(fn, names):
    inputs = [_inputs()[n] for n in names]
    net = Net()
    ref = copy.deepcopy(net)
    compiled = compile_graph(OpGraph(copy.deepcopy(net), fn), inputs, 1)
    assert [n.meta[META_BATCHED] for n in compiled.gm.graph.nodes if n.op == "placeholder"] == [True] * len(names)
    graph = OpGraph(net, fn)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        got = graph(*inputs).to_local()
        want = fn(ref, *inputs)
        opt.zero_grad(), want.backward(), opt.step()
        assert_close(got, want.detach(), f"loss, step {step}")
    for k, v in ref.state_dict().items():
        assert_close(net.state_dict()[k], v, k)


def _refused(fn, names, op):
    inputs = [_inputs()[n] for n in names]
    with pytest.raises(graphc.GraphcError) as info:
        compile_graph(OpGraph(Net(), fn), inputs, 1)
    msg = str(info.value)
    assert "couples rows of the batch" in msg and op in msg, msg


# -- ops that keep rows where they work along another dim ------------------------------------
def addmm(net, xs):  # HF GPT-2's Conv1D
    h = torch.addmm(net.lin.bias, xs.view(-1, D), net.lin.weight.T)
    return h.view(xs.shape[0], T, D).tanh().pow(2).mean()


def addmm_rows_as_weight(net, x):  # the batch's rows as the contracted dim: a sum over rows, used nonlinearly
    return torch.addmm(net.lin.weight, x.T, x).tanh().sum()


def addmv(net, x):
    return torch.addmv(net.table[:1, 0].expand(x.shape[0]), x, net.lin.bias).tanh().mean()


def baddbmm(net, xs):
    w = net.lin.weight.expand(xs.shape[0], D, D)
    return torch.baddbmm(net.lin.bias, xs, w).sigmoid().mean()


def tile_features(net, x):
    return net.lin(x).repeat(3, 1, 2).tanh().mean()


def tile_rows_added_back(net, xs):  # tiled rows are not each token's own copies
    flat = xs.reshape(-1, D)
    token = torch.arange(flat.shape[0]).repeat_interleave(2)
    return torch.zeros_like(flat).index_add(0, token, net.lin(flat.repeat(2, 1))).pow(2).mean()


def stacked_beside_repeats(net, xs):  # each row's two entries together, as repeat_interleave keeps them
    flat = xs.reshape(-1, D)
    both = torch.stack([net.lin(flat), net.lin(flat).exp()], 1).flatten(0, 1)
    return (flat.repeat_interleave(2, dim=0) + both).pow(2).mean()


def concatenated_beside_repeats(net, xs):  # [all of a, all of b] against each row twice in a row
    flat = xs.reshape(-1, D)
    both = torch.cat([net.lin(flat), net.lin(flat).exp()])
    return (flat.repeat_interleave(2, dim=0) + both).pow(2).mean()


def index_select_features(net, x):
    return net.lin(x).index_select(1, torch.tensor([4, 0, 2])).tanh().mean()


def index_select_rows(net, x):
    return net.lin(x).index_select(0, torch.tensor([1, 0])).tanh().mean()


def index_select_table(net, y, x):  # a table read by the batch's labels: the labels' rows
    return (net.table.index_select(0, y) * net.lin(x)).tanh().mean()


def gather_features(net, x, k):
    return net.lin(x).gather(1, k).tanh().mean()


def gather_keywords(net, x, k):  # arguments by name read as by position
    return net.lin(x).gather(dim=1, index=k).tanh().mean()


def gather_rows_keywords(net, x, k):
    return net.lin(x).gather(dim=0, index=k).tanh().mean()


def scatter_number(net, x, k):  # an int value is a number, not the position of an argument
    return net.lin(x).scatter(1, k, 0).tanh().mean()


def gather_rows(net, x, k):
    return net.lin(x).gather(0, k).tanh().mean()


def take_along_features(net, x, k):
    return torch.take_along_dim(net.lin(x), k, dim=1).tanh().mean()


def take_along_rows(net, x, k):
    return torch.take_along_dim(net.lin(x), k[:, :1], dim=0).tanh().mean()


def scatter_features(net, x, y):  # a one-hot of the labels by scatter, per row
    onehot = torch.zeros(x.shape[0], D).scatter(1, y[:, None], 1.0)
    return (net.lin(x) * onehot).tanh().mean()


def scatter_add_features(net, x, k):
    h = torch.zeros(x.shape[0], D).scatter_add(1, k, net.lin(x)[:, :2])
    return h.tanh().mean()


def scatter_rows(net, x, k):
    h = net.lin(x)
    return torch.zeros_like(h).scatter(0, k, h[:, :2]).tanh().mean()


def scatter_add_rows(net, x, k):
    h = net.lin(x)
    return torch.zeros_like(h).scatter_add(0, k, h[:, :2]).tanh().mean()


def index_add_features(net, x):
    h = torch.zeros(x.shape[0], C).index_add(1, torch.tensor([0, 2, 2, 4, 1, 3]), net.lin(x))
    return h.tanh().mean()


def index_add_rows(net, x, y):  # rows added into the rows the labels name
    h = net.lin(x)
    return torch.zeros_like(h).index_add_(0, y, h).tanh().mean()


def index_add_rows_in_place(net, x, y):  # the same, its result unused: `out` is what the loss reads
    h = net.lin(x)
    out = torch.zeros_like(h)
    out.index_add_(0, y, h)
    return out.tanh().mean()


def index_fill_features(net, x):
    return net.lin(x).index_fill(1, torch.tensor([0, 3]), 0.0).tanh().mean()


def index_fill_rows(net, x):  # rows 1 and 3 of the batch; per micro-batch, of each micro-batch
    return net.lin(x).index_fill(0, torch.tensor([1, 3]), 0.0).tanh().mean()


def index_copy_features(net, x):
    h = net.lin(x)
    return h.index_copy(1, torch.tensor([5, 0]), h[:, :2].exp()).tanh().mean()


def index_copy_rows(net, x):
    return net.lin(x).index_copy(0, torch.tensor([0, 2]), net.table[:2].exp()).tanh().mean()


def index_put_features(net, x):  # features 4 and 0 of every row
    h = net.lin(x).T
    return h.index_put((torch.tensor([4, 0]),), net.table[0, :1]).tanh().mean()


def index_put_rows(net, x, k):  # rows named by data
    h = net.lin(x)
    return h.index_put((k[:, 0], k[:, 1]), h[:, 0]).tanh().mean()


def masked_scatter_rows(net, x, mask):  # the source's entries counted across the rows
    h = net.lin(x)
    return h.masked_scatter(mask[:, None].expand_as(h), (2 * h).exp()).tanh().mean()


def masked_fill_rows(net, x, mask):
    return net.lin(x).masked_fill(mask[:, None], 0.0).tanh().mean()


def where_rows(net, x, mask):
    h = net.lin(x)
    return torch.where(mask[:, None], h, -2 * h).tanh().mean()


def masked_fill_batch_mean(net, x):  # the batch's mean meets its own rows: still a coupling
    h = net.lin(x)
    return h.masked_fill(h > h.mean(0), 0.0).tanh().mean()


def where_batch_mean(net, x):  # the batch's mean meets its own rows: still a coupling
    h = net.lin(x)
    return torch.where(h > h.mean(0), h, torch.zeros_like(h)).tanh().mean()


def topk_features(net, x):
    return net.lin(x).topk(2, dim=1)[0].tanh().mean()


def topk_rows(net, x):
    return net.lin(x).topk(2, dim=0)[0].tanh().mean()


def sort_features(net, x):
    v, i = net.lin(x).sort(dim=-1)
    return (v * i).tanh().mean()


def sort_rows(net, x):
    return net.lin(x).sort(dim=0)[0][:1].tanh().mean()


def argsort_features(net, x):
    h = net.lin(x)
    return h.gather(1, h.argsort(dim=1)[:, :3]).tanh().mean()


def argsort_rows(net, x):
    h = net.lin(x)
    return h.gather(1, h.argsort(dim=0)[:, :3]).tanh().mean()


def embedding_bag_functional(net, ids, x):
    return (F.embedding_bag(ids, net.table, mode="sum") * net.lin(x)).tanh().mean()


def embedding_bag_module(net, ids, x):
    return (net.bag(ids) * net.lin(x)).tanh().mean()


def embedding_bag_flat(net, ids, x):  # offsets into the whole batch's flat list
    bags = F.embedding_bag(ids.flatten(), net.table, torch.arange(0, ids.numel(), T), mode="mean")
    return (bags * net.lin(x)).tanh().mean()


def advanced_index_features(net, x, k):  # per row, two features picked by the row's own indices
    h = net.lin(x)
    return h[torch.arange(x.shape[0])[:, None], k].tanh().mean()


def advanced_index_table(net, ids, xs):  # a table read by the tokens' ids: the tokens' rows
    return (net.table[ids] * net.lin(xs)).tanh().mean()


def advanced_index_rows(net, x, k):
    return net.lin(x)[k[:, 0]].tanh().mean()


@pytest.mark.parametrize("fn, names", [
    (addmm, ("xs",)), (addmv, ("x",)), (baddbmm, ("xs",)), (tile_features, ("x",)),
    (stacked_beside_repeats, ("xs",)),
    (index_select_features, ("x",)), (index_select_table, ("y", "x")),
    (gather_features, ("x", "k")), (gather_keywords, ("x", "k")), (take_along_features, ("x", "k")),
    (scatter_number, ("x", "k")),
    (scatter_features, ("x", "y")), (scatter_add_features, ("x", "k")), (index_add_features, ("x",)),
    (index_fill_features, ("x",)), (index_copy_features, ("x",)), (index_put_features, ("x",)),
    (masked_fill_rows, ("x", "mask")), (where_rows, ("x", "mask")),
    (topk_features, ("x",)), (sort_features, ("x",)), (argsort_features, ("x",)),
    (embedding_bag_functional, ("ids", "x")), (embedding_bag_module, ("ids", "x")),
    (advanced_index_features, ("x", "k")), (advanced_index_table, ("ids", "xs")),
])
def test_op_along_another_dim_keeps_rows_and_equals_eager(fn, names):
    _equal_to_eager(fn, names)


@pytest.mark.parametrize("fn, names, op", [
    (addmm_rows_as_weight, ("x",), "torch.addmm(net.lin.weight, x.T, x)"),
    (tile_rows_added_back, ("xs",), "'repeat' tiles the batch's rows"),
    (concatenated_beside_repeats, ("xs",), "concatenated with rows of the batch"),
    (index_select_rows, ("x",), "'index_select' picks rows of the batch"),
    (gather_rows, ("x", "k"), "'gather' picks rows of the batch"),
    (gather_rows_keywords, ("x", "k"), "'gather' picks rows of the batch"),
    (take_along_rows, ("x", "k"), "'take_along_dim' picks rows of the batch"),
    (scatter_rows, ("x", "k"), "'scatter' writes entries into rows of the batch"),
    (scatter_add_rows, ("x", "k"), "'scatter_add' writes entries into rows of the batch"),
    (index_add_rows, ("x", "y"), "'index_add' adds entries into rows of the batch"),
    (index_add_rows_in_place, ("x", "y"), "'index_add' adds entries into rows of the batch"),
    (index_fill_rows, ("x",), "'index_fill' writes entries into rows of the batch"),
    (index_copy_rows, ("x",), "'index_copy' writes entries into rows of the batch"),
    (index_put_rows, ("x", "k"), "'index_put' writes"),
    (masked_scatter_rows, ("x", "mask"), "masked_scatter takes the source's entries in flat order"),
    (masked_fill_batch_mean, ("x",), "h.masked_fill(h > h.mean(0), 0.0)"),
    (where_batch_mean, ("x",), "torch.where(h > h.mean(0), h, torch.zeros_like(h))"),
    (topk_rows, ("x",), "'topk' runs across the batch's rows"),
    (sort_rows, ("x",), "'sort' runs across the batch's rows"),
    (argsort_rows, ("x",), "'argsort' runs across the batch's rows"),
    (embedding_bag_flat, ("ids", "x"), "an embedding bag cuts a flat list"),
    (advanced_index_rows, ("x", "k"), "an index tensor picks rows of the batch"),
])
def test_op_along_the_batch_dim_is_refused(fn, names, op):
    _refused(fn, names, op)


# -- the MoE dispatch: tokens routed within the flattened batch*seq rows and put back --------
def _route(net, xs):
    flat = xs.reshape(-1, D)  # [B*T, D]: the batch's rows stay the outer factor
    weights, experts = net.router(flat).softmax(-1).topk(K, dim=-1)  # top-2 over the experts
    return flat, weights / weights.sum(-1, keepdim=True), experts


def _experts(net, tokens, experts):
    w = net.experts[experts.reshape(-1)]  # [B*T*K, D, D]: each pair's expert, looked up per row
    return torch.bmm(w, tokens.unsqueeze(-1)).squeeze(-1).relu()


def moe_batched(net, xs):  # transformers' batched_mm experts
    flat, weights, experts = _route(net, xs)
    out = _experts(net, flat.repeat_interleave(K, dim=0), experts) * weights.reshape(-1, 1)
    return out.view(-1, K, D).sum(1).view(xs.shape).pow(2).mean()


def moe_index_add(net, xs):  # per-pair index lists into the tokens, added back into the tokens' rows
    flat, weights, experts = _route(net, xs)
    token = torch.arange(flat.shape[0]).repeat_interleave(K)
    out = _experts(net, flat.index_select(0, token), experts) * weights.reshape(-1, 1)
    final = torch.zeros_like(flat)
    final.index_add_(0, token, out)  # in place, its result unused: final is what the loss reads
    return (final + flat[token].view(-1, K, D).mean(1)).pow(2).mean()


def moe_sorted(net, xs):  # grouped by expert: a sort across the batch's tokens
    flat, weights, experts = _route(net, xs)
    order = experts.reshape(-1).argsort()
    out = _experts(net, flat[order // K], experts.reshape(-1)[order])
    return out.pow(2).mean()


def moe_counts(net, xs, ids):  # each token repeated by a count held per token (a tensor)
    flat, counts = xs.reshape(-1, D), torch.full_like(ids.reshape(-1), 2)
    return net.lin(flat.repeat_interleave(counts, dim=0, output_size=2 * flat.shape[0])).pow(2).mean()


@pytest.mark.parametrize("fn", [moe_batched, moe_index_add])
def test_moe_dispatch_within_the_rows_equals_eager(fn):
    _equal_to_eager(fn, ("xs",))


@pytest.mark.parametrize("fn, names, op", [
    (moe_sorted, ("xs",), "'argsort' runs across the batch's rows"),
    (moe_counts, ("xs", "ids"), "repeat_interleave repeats rows of the batch by counts from data"),
])
def test_moe_dispatch_across_the_rows_is_refused(fn, names, op):
    _refused(fn, names, op)
