"""config.set_deferred_batch_norm(True) against its definition in eager PyTorch (float64).

Definition (seed 002's deferred_batch_norm): with m micro-batches, each is normalised with
its own statistics (so losses and parameters equal eager gradient accumulation), and the
running statistics take one update per step with the statistics of the whole mini-batch
(the concatenation of the micro-batches' BatchNorm inputs); num_batches_tracked counts steps.
The eager reference runs accumulation with momentum 0 (no per-micro-batch update), records
each BatchNorm's inputs, and applies that one update after the step.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from helpers import accumulate_grads, assert_same_as_eager, graphc_train, run_world

STEPS, ACC = 3, 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.front = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.back = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=None), nn.ReLU(),
                                  nn.Linear(8, 3))

    def forward(self, x):
        return self.back(self.front(x))


class Deferred(graphc.Graph):
    def __init__(self, model, pipeline):
        super().__init__()
        self.model = model
        if pipeline:
            self.model.front.config.set_stage(0, graphc.placement("cpu", ranks=[0]))
            self.model.back.config.set_stage(1, graphc.placement("cpu", ranks=[1]))
        self.config.set_gradient_accumulation_steps(ACC)
        self.config.set_deferred_batch_norm(True)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def batches():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 5, generator=g) * 2 + 1, torch.randint(0, 3, (8,), generator=g))
            for _ in range(STEPS)]


def eager_deferred(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    losses = []
    for x, y in batches():
        seen = {bn: [] for bn in bns}
        hooks = [bn.register_forward_pre_hook(lambda mod, args: seen[mod].append(args[0].detach()))
                 for bn in bns]
        saved = {bn: (bn.momentum, bn.running_mean.clone(), bn.running_var.clone(),
                      bn.num_batches_tracked.clone()) for bn in bns}
        opt.zero_grad()
        total = accumulate_grads(model, F.cross_entropy, x, y, ACC)
        opt.step()
        for h in hooks:
            h.remove()
        for bn in bns:  # one update from the whole mini-batch, as eager on the whole batch does
            momentum, mean0, var0, n0 = saved[bn]
            xs = torch.cat(seen[bn])
            n = n0 + 1
            f = 1.0 / float(n) if momentum is None else momentum
            with torch.no_grad():
                bn.running_mean.copy_((1 - f) * mean0 + f * xs.mean(0))
                bn.running_var.copy_((1 - f) * var0 + f * xs.var(0, unbiased=True))
                bn.num_batches_tracked.copy_(n)
        losses.append(total)
    return losses, model.state_dict()


def _train(rank, world, pipeline):
    torch.manual_seed(0)
    model = Net()
    losses, state = graphc_train(Deferred(model, pipeline), batches())
    return {"losses": losses, "state": state}


def _reference():
    torch.manual_seed(0)
    return eager_deferred(Net())


def test_deferred_batch_norm_one_process():
    got = _train(0, 1, pipeline=False)
    want_losses, want_state = _reference()
    assert_same_as_eager(got["losses"], got["state"], want_losses, want_state, "deferred BN, 1 rank")
    assert got["state"]["front.1.num_batches_tracked"].item() == STEPS


@pytest.mark.world
def test_deferred_batch_norm_pipeline_of_two():
    got = run_world(_train, 2, True)[1]
    want_losses, want_state = _reference()
    assert_same_as_eager(got["losses"], got["state"], want_losses, want_state, "deferred BN, pipeline 2")
