"""torch.fx.wrap'd functions traced through (NOTE: fx.wrap'd functions,
graphc/passes/traced_wraps.py). torchvision marks `stochastic_depth` (EfficientNet,
ConvNeXt), Swin's shifted-window attention and MaxViT's partitions with torch.fx.wrap; kept
opaque, each had no SBP rule and gathered the batch on data-parallel stages (every later
layer ran whole on every rank). `stochastic_depth` below follows torchvision's semantics
(torchvision itself does not import beside the CPU torch 2.13 here). Its mask is drawn into
`torch.empty(size)`, a tensor made while tracing: that draw was frozen at trace time, one
mask for every step (NOTE: Tensors outside the trace)."""
import pytest
import torch
import torch.nn as nn

from layouts import SquaredError, assert_same, batches, eager, fallbacks, replicated, train


@torch.fx.wrap
def stochastic_depth(input, p: float, mode: str, training: bool = True):
    """Drops whole rows (mode "row") or the whole batch with probability p, as torchvision's."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"drop probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    survival_rate = 1.0 - p
    size = [input.shape[0]] + [1] * (input.ndim - 1) if mode == "row" else [1] * input.ndim
    noise = torch.empty(size, dtype=input.dtype, device=input.device)
    noise = noise.bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return input * noise


class DropPathBlock(nn.Module):
    """ConvNeXt's residual: x + stochastic_depth(layer(x))."""

    def __init__(self, p: float):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.layer = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)
        self.p = p

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h + stochastic_depth(self.layer(h), self.p, "row", self.training))


def _eager(make_model, eval_mode=False):
    torch.manual_seed(0)
    model = make_model()
    model.train(not eval_mode)
    return eager(model, batches())


def _run(make_model, layout, acc=2, eval_mode=False):
    graphs = []

    def make(layout):
        torch.manual_seed(0)
        model = make_model()
        model.train(not eval_mode)
        return SquaredError(model, layout, accumulation=acc)
    got = train(layout, make, batches(), graphs=graphs)
    return got, graphs


@pytest.mark.parametrize("p,eval_mode", [(0.0, False), (0.5, True)], ids=["p0-train", "p0.5-eval"])
def test_a_wrapped_function_keeps_the_batch_split(p, eval_mode):
    got, graphs = _run(lambda: DropPathBlock(p), "dp2", eval_mode=eval_mode)
    assert_same(got, _eager(lambda: DropPathBlock(p), eval_mode), "dp2")
    assert fallbacks(graphs[0]) == [] and replicated(graphs[0]) == {0: 0.0}


def test_its_random_mask_is_drawn_every_step_as_in_eager():
    # one rank, no accumulation: graphc draws eager's own masks (NOTE: Replica-equal randomness)
    got, graphs = _run(lambda: DropPathBlock(0.5), "one", acc=1)
    assert_same(got, _eager(lambda: DropPathBlock(0.5)), "one")
    assert any(n.target == "bernoulli_" for n in graphs[0].compiled.gm.graph.nodes)
