"""The host side of a one-process step (issue 38): what the runtime holds between calls and
what it skips scanning, checked against eager on the same batches (float64, 1e-10).

One run serves both tests (one compile): a graph and its eager twin train three steps; no
hook exists for the first two, and before the third a post-accumulate-grad hook is
registered on both."""
import copy
import weakref
from dataclasses import dataclass, field
from typing import List

import pytest
import torch
import torch.nn as nn

import graphc
from helpers import assert_close
from models import SkipNet, make_batches


class OneStage(graphc.Graph):
    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.loss_fn = nn.CrossEntropyLoss()
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


class _Halver:
    """A post-accumulate-grad hook: records each call's gradient norm, halves the gradient."""

    def __init__(self):
        self.norms: List[float] = []

    def __call__(self, p):
        self.norms.append(p.grad.norm().item())
        p.grad.mul_(0.5)


@dataclass
class _Run:
    losses: List[float] = field(default_factory=list)
    eager_losses: List[float] = field(default_factory=list)
    grads_between_calls: List[bool] = field(default_factory=list)   # any .grad set after a call
    kept_alive: List[List[bool]] = field(default_factory=list)      # step 1's kept gradients, after each call
    ours: _Halver = field(default_factory=_Halver)
    theirs: _Halver = field(default_factory=_Halver)
    parameters: int = 0
    state: dict = field(default_factory=dict)
    eager_state: dict = field(default_factory=dict)


@pytest.fixture(scope="module")
def run():
    torch.manual_seed(0)
    model, batches, out = SkipNet(2), make_batches(3), _Run()
    twin = copy.deepcopy(model)
    graph, eager_opt = OneStage(model, _sgd(model.parameters())), _sgd(twin.parameters())
    kept = []
    for step, (x, y) in enumerate(batches):
        if step == 2:
            model.head.weight.register_post_accumulate_grad_hook(out.ours)
            twin.head.weight.register_post_accumulate_grad_hook(out.theirs)
        out.losses.append(graph(x, y).to_local().item())
        kept = kept or [weakref.ref(g) for g in graph._runtime.kept_grads]
        out.kept_alive.append([k() is not None for k in kept])
        out.grads_between_calls.append(any(p.grad is not None for p in model.parameters()))
        eager_opt.zero_grad()
        loss = nn.CrossEntropyLoss()(twin(x), y)
        loss.backward()
        eager_opt.step()
        out.eager_losses.append(loss.item())
    out.state, out.eager_state = graph.full_state_dict(), twin.state_dict()
    out.parameters = len(list(model.parameters()))
    return out


def _same_training(run):
    assert_close(torch.tensor(run.losses), torch.tensor(run.eager_losses), "losses")
    for name, value in run.eager_state.items():
        assert_close(run.state[name], value, f"parameter {name}")


def test_gradients_freed_when_the_next_step_starts(run):
    """NOTE: Gradients freed at the next step: .grad is None between calls, as before, while
    the runtime holds the last step's gradients (every parameter's) until the next step
    starts, where eager's zero_grad() frees them; the numbers are eager's."""
    assert run.grads_between_calls == [False, False, False]
    assert len(run.kept_alive[0]) == run.parameters and all(run.kept_alive[0])
    assert not any(run.kept_alive[1]), "the first step's gradients outlived the next step"
    _same_training(run)


def test_grad_hook_registered_after_quiet_steps_is_called(run):
    """The per-step scan for the user's post-accumulate-grad hooks is skipped while no hook has
    been registered since it found none (NOTE: Hook registrations counted): a hook registered
    after two quiet steps is still called once in the third, on the whole gradient, as eager's."""
    assert len(run.ours.norms) == len(run.theirs.norms) == 1
    assert_close(torch.tensor(run.ours.norms), torch.tensor(run.theirs.norms), "the hook's gradient norm")
    _same_training(run)
