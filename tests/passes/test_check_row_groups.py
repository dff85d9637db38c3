"""check_row_groups: batched inputs split over different shard counts are refused under
accumulation (they would pair different rows per micro-batch: a 3-rank run of the refused
program below trained to losses 1.86, 1.48, 2.09 where eager gives 1.67, 1.83, 1.77)."""
import pytest
import torch
import torch.nn as nn

import graphc
from graphc import sbp
from graphc.passes.check_row_groups import row_shards
from graphc.placement import Layout
from helpers import compile_graph, global_input

P01, P2, P23 = (graphc.placement("cpu", r) for r in ([0, 1], [2], [2, 3]))
MESH = graphc.placement("cpu", [[0, 1], [2, 3]])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Train(graphc.Graph):
    def __init__(self, accumulation, second=P2):
        super().__init__()
        self.model = Net()
        self.model.a.config.set_stage(0, P01)
        self.model.b.config.set_stage(1, second)
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))

    def build(self, x, y):
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def compile_with(accumulation, y_layout, second=P2):
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    y = global_input(y, *y_layout) if y_layout else y
    return compile_graph(Train(accumulation, second), [global_input(x, P01, sbp.split(0)), y], 4)


def test_inputs_split_over_different_shard_counts_are_refused_under_accumulation():
    with pytest.raises(graphc.GraphcError, match=r"input 'x' splits the batch's rows over 2 shard\(s\)"
                       r".*input 'y' over 1.*micro-batch k would pair rows.*Fix: split both"):
        compile_with(2, (P2, sbp.split(0)))
    with pytest.raises(graphc.GraphcError, match=r"'y' over 1 \(passed whole on every rank\)"):
        compile_with(2, None)


def test_equal_shard_counts_and_accumulation_1_compile():
    assert compile_with(2, (P23, sbp.split(0)), P23).num_microbatches == 2
    assert compile_with(1, (P2, sbp.split(0))).num_microbatches == 1


def test_shards_count_every_mesh_axis_that_splits_rows():
    assert row_shards(None) == 1
    assert row_shards(Layout(P01, sbp.split(0))) == 2 and row_shards(Layout(P01, sbp.split(1))) == 1
    assert row_shards(Layout(MESH, (sbp.split(0), sbp.broadcast))) == 2
    assert row_shards(Layout(MESH, (sbp.split(0), sbp.split(0)))) == 4
