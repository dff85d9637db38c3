"""find_batch_dims decides by data flow which inputs carry the batch dim, and refuses rows
coupled across the batch under accumulation > 1. Plan level: compiled in one process."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc.compiler import compile as compile_graph
from graphc.meta import META_BATCHED, META_ROWS
from transformer_models import BlockNet, CutGraph, block_batches

B, D, C = 8, 6, 5


class LossGraph(graphc.Graph):
    """build() is `fn(model, *inputs)`, so each test states only its loss."""

    def __init__(self, fn, accumulation, training=True):
        super().__init__()
        self.model = nn.Linear(D, D)
        self.fn, self.train_step = fn, training
        self.config.set_gradient_accumulation_steps(accumulation)

    def build(self, *inputs):
        out = self.fn(self.model, *inputs)
        if self.train_step:
            out.backward()
        return out


def _compile(fn, inputs, accumulation=2, training=True):
    return compile_graph(LossGraph(fn, accumulation, training), inputs, 1)


def _split(compiled):
    return [n.meta[META_BATCHED] for n in compiled.gm.graph.nodes if n.op == "placeholder"]


def _output_rows(compiled):
    return [str(n.meta[META_ROWS]) for n in compiled.gm.graph.output_node().all_input_nodes]


def prototypes(model, x, p, y):
    return F.cross_entropy(model(x) @ p.T, y)


def contrastive(model, x):
    z = F.normalize(model(x), dim=1)
    logits = z @ z.T / 0.1
    return F.cross_entropy(logits, torch.arange(z.shape[0]))


def batch_statistic(model, x, y):
    h = model(x)
    return F.mse_loss(h - h.mean(0), y)


def log_volume(model, x):
    z = model(x)
    return -torch.logdet(z.T @ z / B + torch.eye(D))  # a batch sum through an op without a rule


def picked_logits(model, x, y):
    logits = model(x)[:, :C]
    return -(logits.log_softmax(1)[torch.arange(x.shape[0]), y]).mean()


def regularised_prototypes(model, x, p, y):
    return F.cross_entropy(model(x) @ p.T, y) + 0.1 * p.pow(2).mean()


def inputs(*names):
    g = torch.Generator().manual_seed(0)
    make = {"x": lambda: torch.randn(B, D, generator=g), "p": lambda: torch.randn(C, D, generator=g),
            "y": lambda: torch.randint(0, C, (B,), generator=g),
            "mask": lambda: (torch.rand(B, generator=g) > 0.5).double(),
            "t": lambda: torch.randn(B, D, generator=g)}
    return [make[n]() for n in names]


def test_prototypes_are_not_split():
    compiled = _compile(prototypes, inputs("x", "p", "y"))  # C = 5 rows: not divisible by 2
    assert _split(compiled) == [True, False, True]
    assert _output_rows(compiled) == ["rows-mean"]
    assert compiled.programs[0].whole_inputs == ("inputs_1",)  # build(self, *inputs)


def test_regularised_prototypes_are_not_split():
    """p's rows are classes of the loss's softmax: never the batch, even where a mean runs over them."""
    assert _split(_compile(regularised_prototypes, inputs("x", "p", "y"))) == [True, False, True]


def test_prototypes_in_inference_are_not_split():
    compiled = _compile(lambda model, x, p: model(x) @ p.T, inputs("x", "p"), training=False)
    assert _split(compiled) == [True, False] and _output_rows(compiled) == ["rows@0"]


@pytest.mark.parametrize("fn, names, found, line", [
    (contrastive, ("x",), "pairs every row of the batch with every other row", "logits = z @ z.T / 0.1"),
    (batch_statistic, ("x", "t"), "meets the batch's own rows", "return F.mse_loss(h - h.mean(0), y)"),
    (log_volume, ("x",), "goes through 'logdet', which graphc has no rule for",
     "return -torch.logdet(z.T @ z / B + torch.eye(D))"),
])
def test_rows_coupled_across_the_batch_are_refused_with_accumulation(fn, names, found, line):
    with pytest.raises(graphc.GraphcError) as info:
        _compile(fn, inputs(*names), accumulation=2)
    msg = str(info.value)
    for part in ("couples rows of the batch", found, line, "test_find_batch_dims.py",
                 "set_gradient_accumulation_steps(1)"):
        assert part in msg, (part, msg)
    _compile(fn, inputs(*names), accumulation=1)  # one micro-batch: the whole batch, as eager


def gathered_logits(model, x, y):
    logp = model(x)[:, :C].log_softmax(-1)
    return -logp.gather(1, y[:, None]).mean() + 0.5 * model(x).flatten(0).pow(2).mean()


@pytest.mark.parametrize("fn", [picked_logits, gathered_logits])
def test_row_wise_idioms_are_split(fn):
    compiled = _compile(fn, inputs("x", "y"), accumulation=2)
    assert _split(compiled) == [True, True] and _output_rows(compiled) == ["rows-mean"]


def test_token_losses_of_a_transformer_are_split():
    x, y = block_batches()[0]
    compiled = compile_graph(CutGraph(BlockNet(), None, (3,), accumulation=2), [x, y], 2)
    assert _split(compiled) == [True, True] and _output_rows(compiled) == ["rows-mean"]
