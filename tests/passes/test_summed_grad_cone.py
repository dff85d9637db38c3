"""A whole parameter read through whole ops, then by sharded ones (See NOTE: Whole values with
a summed gradient, passes/summed_grad_cone.py): T5's relative position bias, a table looked up,
permuted and sliced to each rank's heads. Its gradient is partial_sum, all-reduced once a
step with the parameters', where each slice all-gathered its gradient every micro-batch.
Equal to eager on the whole batch in the local world (float64, 1e-10) on tensor 2 and
data 2."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from graphc.plan.instructions import AllReduce, Collective
from layouts import SquaredError, assert_same, batches, eager, train


class BiasedPair(nn.Module):
    """layouts.Pair with attention between: a's output as 2 heads of 2 positions, and T5's
    bias: a table summed over its rows and permuted to [heads, L, S], the attention's mask
    (which scaled_dot_product_attention reads split like the heads). Heads split on tensor
    2, the batch on data 2."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.table = nn.Parameter(torch.randn(3, 2, 2, 2))   # [buckets, L, S, heads]
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        bias = self.table.sum(0).permute(2, 0, 1)
        q = self.a(x).view(x.shape[0], 2, 2, 2)
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=bias)
        return self.b(out.reshape(x.shape[0], 8))


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_a_whole_table_read_by_sharded_ops_through_whole_ops_syncs_once_a_step(layout):
    def make(layout):
        torch.manual_seed(0)
        return SquaredError(BiasedPair(), layout)
    graphs = []
    got = train(layout, make, batches(), graphs=graphs)
    torch.manual_seed(0)
    assert_same(got, eager(BiasedPair(), batches()), layout)
    plan = graphs[0].compiled.plans[0]
    synced = [t.name for i in plan.instructions if type(i) is AllReduce for t in i.tensors]
    assert "model.table" in synced
    assert not [i for i in plan.instructions if isinstance(i, Collective) and i.kind == "all_gather"], str(plan)
