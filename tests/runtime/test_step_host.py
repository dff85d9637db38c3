"""The host side of a one-process step (issue 38): what the runtime holds between calls and
what it skips scanning, checked against eager on the same batches (float64, 1e-10)."""
import copy
import weakref

import torch
import torch.nn as nn

import graphc
from helpers import assert_close, assert_same_as_eager, eager_train, graphc_train
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


def test_gradients_freed_when_the_next_step_starts():
    """NOTE: Gradients freed at the next step: .grad is None between calls, as before, while
    the runtime holds the last step's gradients until the next step starts (where eager's
    zero_grad() frees them); the numbers are eager's."""
    torch.manual_seed(0)
    model, batches = SkipNet(2), make_batches(3)
    ref_losses, ref_state = eager_train(copy.deepcopy(model), _sgd, None, nn.CrossEntropyLoss(), batches, 3)
    graph = OneStage(model, _sgd(model.parameters()))
    first = graph(*batches[0]).to_local().item()
    kept = [weakref.ref(g) for g in graph._runtime.kept_grads]
    assert len(kept) == len(list(model.parameters())) and all(k() is not None for k in kept)
    assert all(p.grad is None for p in model.parameters())
    losses, state = graphc_train(graph, batches[1:])
    assert all(k() is None for k in kept), "the first step's gradients outlived the next step"
    assert_same_as_eager([first] + losses, state, ref_losses, ref_state)


class _Halver:
    """A post-accumulate-grad hook: records each call's gradient norm, halves the gradient."""

    def __init__(self):
        self.norms = []

    def __call__(self, p):
        self.norms.append(p.grad.norm().item())
        p.grad.mul_(0.5)


def test_grad_hook_registered_after_quiet_steps_is_called():
    """The per-step scan for the user's post-accumulate-grad hooks is skipped while no hook has
    been registered since it found none (NOTE: Hook registrations counted): a hook registered
    after two quiet steps is still called once in the third, on the whole gradient, as eager's."""
    torch.manual_seed(0)
    model, batches = SkipNet(2), make_batches(3)
    twin = copy.deepcopy(model)
    graph = OneStage(model, _sgd(model.parameters()))
    eager_opt = _sgd(twin.parameters())
    ours, theirs = _Halver(), _Halver()
    for step, (x, y) in enumerate(batches):
        if step == 2:
            model.head.weight.register_post_accumulate_grad_hook(ours)
            twin.head.weight.register_post_accumulate_grad_hook(theirs)
        graph(x, y)
        eager_opt.zero_grad()
        nn.CrossEntropyLoss()(twin(x), y).backward()
        eager_opt.step()
    assert len(ours.norms) == len(theirs.norms) == 1
    assert_close(torch.tensor(ours.norms), torch.tensor(theirs.norms), "the hook's gradient norm")
    full = graph.full_state_dict()
    for name, value in twin.state_dict().items():
        assert_close(full[name], value, f"parameter {name}")
