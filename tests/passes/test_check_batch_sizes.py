"""check_batch_sizes (NOTE: Batch size in a micro-batch): under accumulation 2 the batch's size
read in build() keeps eager's meaning, or the program is refused at the user's line. Compiled
in one process for 2 ranks of data parallel; tests/test_fidelity.py trains the same programs
against eager on every layout (before this pass, `penalty / x.shape[0]` and
`torch.arange(b) / b` as row weights trained silently wrong on all six, and a returned
`x.shape[0]` read 4 for a batch of 8)."""
import pytest
import torch
import torch.nn as nn

import graphc
from graphc import sbp
from helpers import compile_graph, global_input

P01 = graphc.placement("cpu", [0, 1])


def _penalty(model, x, y, out):
    return ((out - y) ** 2).mean() + model.weight.pow(2).sum() / x.shape[0]


def _row_weights(model, x, y, out):
    w = torch.arange(x.shape[0], dtype=x.dtype) / x.shape[0]
    return (w[:, None] * (out - y) ** 2).mean()


def _sum_over_rows(model, x, y, out):
    return ((out - y) ** 2).sum() / x.shape[0]


def _uniform_and_index(model, x, y, out):
    ones = torch.ones(x.shape[0], 1) * 0.5
    picked = out[torch.arange(x.shape[0]), y.argmax(-1)]
    shift = torch.linspace(0, 1, 3).expand(x.shape[0], 3)
    return (ones * (out + shift - y) ** 2).mean() + picked.mean()


class Train(graphc.Graph):
    def __init__(self, loss, returns_rows=False):
        super().__init__()
        self.model = nn.Linear(4, 3)
        self.model.config.set_stage(0, P01)
        self.config.set_gradient_accumulation_steps(2)
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))
        self.loss, self.returns_rows = loss, returns_rows

    def build(self, x, y):
        loss = self.loss(self.model, x, y, self.model(x))
        loss.backward()
        return (loss, {"rows": x.shape[0]}) if self.returns_rows else loss


def _compile(loss, returns_rows=False):
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    inputs = [global_input(x, P01, sbp.split(0)), global_input(y, P01, sbp.split(0))]
    return compile_graph(Train(loss, returns_rows), inputs, 2)


def test_the_size_read_as_a_number_outside_a_batch_mean_is_refused():
    with pytest.raises(graphc.GraphcError, match=r"reads the batch's size as a number at .*test_check_batch_sizes"
                       r".*8 for the whole batch, 4 for a micro-batch.*Fix:"):
        _compile(_penalty)


def test_a_made_tensor_whose_values_differ_along_the_rows_is_refused():
    with pytest.raises(graphc.GraphcError, match=r"makes a tensor of the batch's length at .*test_check_batch_sizes"
                       r".*first rows' values.*Fix:"):
        _compile(_row_weights)


def test_batch_means_uniform_tensors_and_position_indexes_compile():
    assert _compile(_sum_over_rows).num_microbatches == 2
    assert _compile(_uniform_and_index).num_microbatches == 2


def test_a_returned_number_is_the_whole_batchs():
    compiled = _compile(_sum_over_rows, returns_rows=True)
    output = compiled.gm.graph.output_node()
    assert 8 in list(torch.utils._pytree.tree_leaves(output.args)) and 4 not in torch.utils._pytree.tree_leaves(output.args)
