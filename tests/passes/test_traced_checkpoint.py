"""torch.utils.checkpoint in a model's forward (graphc/passes/traced_checkpoint.py): both of
torch's forms trace as the wrapped function and train equal to eager PyTorch on the whole
batch in float64 (helpers.assert_same_as_eager, 1e-10), at accumulation 2, three SGD steps:
in one process, and on a 2-stage pipeline of real gloo ranks."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import graphc
from helpers import assert_same_as_eager, eager_train, graphc_train, run_world

D, C, B = 6, 3, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def inner(self, h, scale=1.0):
        return self.fc2(torch.tanh(self.fc1(h))) * scale

    def forward(self, h):
        return self.inner(h)


class Net(nn.Module):
    """`how` picks the checkpoint call the blocks make (what users and HF models write)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, C)

    def forward(self, x):
        h = self.inp(x)
        if self.how == "reentrant_method":        # a bound method and a positional extra
            h = h + checkpoint(self.blocks[0].inner, h, 0.5, use_reentrant=True)
        elif self.how == "reentrant_module":      # the module itself
            h = h + checkpoint(self.blocks[0], h, use_reentrant=True)
        elif self.how == "non_reentrant_kwargs":  # keyword arguments reach the function
            h = h + checkpoint(self.blocks[0].inner, h, use_reentrant=False, scale=0.5)
        elif self.how == "sequential":
            h = checkpoint_sequential(nn.Sequential(*self.blocks), 2, h, use_reentrant=True)
        if self.how != "sequential":
            h = self.blocks[1](h)
        return self.head(h)


class RawInputNet(nn.Module):
    """A reentrant checkpoint fed the raw batch (no input requires grad): in eager its outputs
    do not require grad, so `first` gets no gradient and SGD leaves it as it was."""

    def __init__(self):
        super().__init__()
        self.first = Block()
        self.head = nn.Linear(D, C)

    def forward(self, x):
        return self.head(checkpoint(self.first, x, use_reentrant=True))


class Train(graphc.Graph):
    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(2)
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(B, D, generator=g), torch.randint(0, C, (B,), generator=g)) for _ in range(3)]


def _train_both(model):
    ref = copy.deepcopy(model)
    batches = _batches()
    graph = Train(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(UserWarning, match="torch.utils.checkpoint at .*test_traced_checkpoint.py:\\d+"):
        losses, state = graphc_train(graph, batches)
    with pytest.warns(UserWarning) if isinstance(model, RawInputNet) else _no_warning():
        ref_losses, ref_state = eager_train(ref, lambda p: torch.optim.SGD(p, lr=0.1), None,
                                            F.cross_entropy, batches, len(batches))
    return losses, state, ref_losses, ref_state


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("how", ["reentrant_method", "reentrant_module", "non_reentrant_kwargs",
                                 "sequential"])
def test_checkpoint_in_forward_equals_eager(how):
    torch.manual_seed(0)
    assert_same_as_eager(*_train_both(Net(how)), what=how)


def test_reentrant_checkpoint_on_the_raw_batch_leaves_its_parameters_as_eager_does():
    torch.manual_seed(0)
    model = RawInputNet()
    before = copy.deepcopy(model.first.state_dict())
    losses, state, ref_losses, ref_state = _train_both(model)
    assert_same_as_eager(losses, state, ref_losses, ref_state, what="raw input")
    for k, v in before.items():     # eager's quirk, kept: no gradient reaches `first`
        assert torch.equal(state[f"first.{k}"], v), k


def test_checkpoint_outside_tracing_is_torchs_own():
    """After a compile, torch's checkpoint is restored: eager use still recomputes."""
    torch.manual_seed(0)
    model = Net("reentrant_method")
    graph = Train(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batches()[0]
    with pytest.warns(UserWarning):
        graph(x, y)
    calls = []
    h = torch.randn(2, D, requires_grad=True)

    def fn(t):
        calls.append(1)
        return t * t                 # saves t: the backward needs the recompute

    checkpoint(fn, h, use_reentrant=True).sum().backward()
    checkpoint(fn, h, use_reentrant=False).sum().backward()
    assert len(calls) == 4 and torch.allclose(h.grad, 4 * h)   # each recomputed once


class PipelineTrain(graphc.Graph):
    """Net's blocks on two stages: a checkpointed region on each rank of a pipeline."""

    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.model.inp.config.set_stage(0, graphc.placement("cpu", ranks=[0]))
        self.model.blocks[0].config.set_stage(0, graphc.placement("cpu", ranks=[0]))
        self.model.blocks[1].config.set_stage(1, graphc.placement("cpu", ranks=[1]))
        self.model.head.config.set_stage(1, graphc.placement("cpu", ranks=[1]))
        self.config.set_gradient_accumulation_steps(2)
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _pipeline_worker(rank, world, how):
    torch.manual_seed(0)
    model = Net(how)
    return graphc_train(PipelineTrain(model, torch.optim.SGD(model.parameters(), lr=0.1)), _batches())


@pytest.mark.world
@pytest.mark.parametrize("how", ["reentrant_module", "non_reentrant_kwargs"])
def test_checkpoint_on_a_pipeline_equals_eager(how):
    torch.manual_seed(0)
    ref = Net(how)
    batches = _batches()
    ref_losses, ref_state = eager_train(ref, lambda p: torch.optim.SGD(p, lr=0.1), None,
                                        F.cross_entropy, batches, len(batches))
    results = run_world(_pipeline_worker, 2, how)
    losses, state = results[1]          # the loss lives on the last stage
    assert_same_as_eager(losses, state, ref_losses, ref_state, what=f"pipeline 2, {how}")
