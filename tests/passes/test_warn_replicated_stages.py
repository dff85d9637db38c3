"""warn_replicated_stages: a stage on several ranks where nothing is split is named (each of
its ranks would compute the same thing); a batch split(0) over them, or a one-rank stage,
is not."""
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from helpers import compile_graph, global_input

P01 = graphc.placement("cpu", [0, 1])


class Train(graphc.Graph):
    def __init__(self, on):
        super().__init__()
        self.model = nn.Linear(4, 3)
        self.model.config.set_stage(0, on)

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _warnings(graph, inputs, world):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compile_graph(graph, inputs, world)
    return [str(w.message) for w in caught if "computes the same thing" in str(w.message)]


def test_plain_batch_on_two_ranks_is_named():
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    said = _warnings(Train(P01), [x, y], 2)
    assert len(said) == 1 and "stage 0 is placed on ranks [0, 1]" in said[0] and "split(0)" in said[0]


def test_split_batch_and_one_rank_stage_are_not():
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    assert _warnings(Train(P01), [global_input(x, P01, graphc.sbp.split(0)),
                                  global_input(y, P01, graphc.sbp.split(0))], 2) == []
    assert _warnings(Train(graphc.placement("cpu", [0])), [x, y], 1) == []
