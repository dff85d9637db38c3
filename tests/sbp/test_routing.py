"""SBP rules of routing and indexing ops (graphc/sbp/routing.py, See NOTE: Routing keeps the
batch split): their signatures on a split batch, in one process, and a toy router built of
all of them trained on data 2 (local world) equal to eager on the whole batch (float64,
1e-10) with no gathering fallback."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphc.placement import PartialSum, Split
from layouts import SquaredError, assert_same, batches, eager, fallbacks, train
from test_rules import _sigs


def test_router_ops_keep_the_rows_they_do_not_mix_split():
    def fn(x):   # x [4, 6, 8] split(0)
        values, ids = torch.topk(x, 2, dim=-1)
        return (values, ids.repeat_interleave(3, dim=0), x.unsqueeze(1).squeeze(1), F.one_hot(ids, 8),
                torch.gather(x, 2, ids), torch.sort(x, -1).values, x.index_add(2, torch.tensor([1, 0]), values))
    sigs = _sigs(fn)
    for name in ("topk", "repeat_interleave", "unsqueeze", "squeeze", "one_hot", "gather", "sort", "index_add"):
        assert sigs[name].out == (Split(0),) and not sigs[name].fallback, (name, sigs[name])


def test_a_lookup_by_split_ids_is_split_and_of_split_rows_partial():
    table = torch.randn(5, 8)
    sigs = _sigs(lambda x: table[x.long()], shape=(4, 3))
    assert sigs["getitem"].out == (Split(0),) and not sigs["getitem"].fallback
    sigs = _sigs(lambda x: x[torch.tensor([[0, 1], [1, 1]])], shape=(4, 6))   # rows of the split dim
    assert sigs["getitem"].out == (PartialSum(),)


def test_topk_over_the_split_dim_has_no_sharded_form():
    sigs = _sigs(lambda x: torch.topk(x, 2, dim=0))
    assert sigs["topk"].out != (Split(0),) and not sigs["topk"].fallback


class Routed(nn.Module):
    """A top-2 mixture of 4 experts between two Linears (layouts.Pair's a and b), written with
    every routing op the rules cover."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.router = nn.Linear(8, 4)
        self.experts = nn.Parameter(torch.randn(4, 8, 8) / 3)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        probs = F.softmax(self.router(h), dim=-1)
        weights, ids = torch.topk(probs, 2, dim=-1)
        pairs = h.repeat_interleave(2, dim=0)
        out = torch.bmm(self.experts[ids.reshape(-1)], pairs.unsqueeze(-1)).squeeze(-1)
        out = (out * weights.reshape(-1, 1)).view(-1, 2, 8).sum(1)
        hits = F.one_hot(ids, 4).sum(1).to(h.dtype)             # [N, 4] experts chosen per token
        chosen = torch.gather(probs, 1, ids).sum(-1, keepdim=True)
        spread = torch.zeros_like(h).index_add(1, torch.tensor([0, 2, 4, 6]), hits * probs)
        return self.b(out + chosen * torch.sort(h, -1).values + spread)


def test_a_router_on_data_2_equals_eager_without_gathering():
    def make(layout):
        torch.manual_seed(0)
        return SquaredError(Routed(), layout)
    graphs = []
    got = train("dp2", make, batches(), graphs=graphs)
    torch.manual_seed(0)
    assert_same(got, eager(Routed(), batches()), "dp2")
    assert fallbacks(graphs[0]) == []
