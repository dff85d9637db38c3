"""BatchNorm on a channel whose mean is large against its spread (mean 1e4, std 1e-2), float64.

Sync-BN (the batch split over ranks) and deferred BN (micro-batches) combine per-shard
statistics. Sums of (x - k) and (x - k)^2 about a shift k far from the mean lose the variance
to cancellation (parameters 4e-8 off); taken about the batch mean, with the sum about it
as a correction (See NOTE: synchronised batch norm), they equal eager's BatchNorm on the
whole batch within the oracle's 1e-10. Layouts: one process, data 2 on real ranks, deferred BN at accumulation 2 in
one process and on data 2. The eager reference for deferred BN normalises each micro-batch
with its own statistics and updates the running statistics once from the whole mini-batch.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from helpers import accumulate_grads, assert_same_as_eager, run_world

STEPS, BATCH = 3, 8
P01 = graphc.placement("cpu", [0, 1])


class Net(nn.Module):
    """x [N, 3, 6] -> a Conv1d whose channel 0 has mean 1e4 and std about 1e-2, BatchNorm1d
    over batch and length, and a BatchNorm1d(momentum=None) on features."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3)
        with torch.no_grad():
            self.conv.weight[0] *= 1e-2
            self.conv.bias[0] = 1e4
        self.bn = nn.BatchNorm1d(4)
        self.fc = nn.Linear(16, 4)
        with torch.no_grad():
            self.fc.weight[1] *= 1e-2
            self.fc.bias[1] = -1e4
        self.bn2 = nn.BatchNorm1d(4, momentum=None)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x))).flatten(1)
        return self.head(F.relu(self.bn2(self.fc(h))))


class Train(graphc.Graph):
    def __init__(self, model, acc):
        super().__init__()
        self.model = model
        if acc > 1:
            self.config.set_gradient_accumulation_steps(acc)
            self.config.set_deferred_batch_norm(True)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, 3, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(STEPS)]


def _eager(acc):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    bns = [model.bn, model.bn2]
    losses = []
    for x, y in _batches():
        seen = {bn: [] for bn in bns}
        hooks = [bn.register_forward_pre_hook(lambda mod, args: seen[mod].append(args[0].detach()))
                 for bn in bns]
        saved = {bn: (bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone())
                 for bn in bns}
        opt.zero_grad()
        losses.append(accumulate_grads(model, F.cross_entropy, x, y, acc))
        opt.step()
        for h in hooks:
            h.remove()
        for bn in bns:  # deferred: one update per step from the whole mini-batch
            mean0, var0, n0 = saved[bn]
            xs = torch.cat(seen[bn]).transpose(0, 1).flatten(1)
            f = 1.0 / float(n0 + 1) if bn.momentum is None else bn.momentum
            with torch.no_grad():
                bn.running_mean.copy_((1 - f) * mean0 + f * xs.mean(1))
                bn.running_var.copy_((1 - f) * var0 + f * xs.var(1, unbiased=True))
                bn.num_batches_tracked.copy_(n0 + 1)
    return losses, model.state_dict()


def _rows(t, rank, world, acc):
    """This rank's rows, such that micro-batch k of the split batch is eager's t.chunk(acc)[k]."""
    return torch.cat([part.chunk(world)[rank] for part in t.chunk(acc)])


def _train(rank, world, acc):
    torch.manual_seed(0)
    model = Net()
    if world > 1:
        graphc.to_global(model, placement=P01, sbp=sbp.broadcast)
    graph = Train(model, acc)
    losses = []
    for x, y in _batches():
        if world > 1:
            x = graphc.to_global(_rows(x, rank, world, acc), placement=P01, sbp=sbp.split(0))
            y = graphc.to_global(_rows(y, rank, world, acc), placement=P01, sbp=sbp.split(0))
        loss = graph(x, y).to_local()
        losses += [loss.item()] if loss.numel() else []
    return {"losses": losses, "state": graph.full_state_dict()}


def _check(got, acc, what):
    want_losses, want_state = _eager(acc)
    assert_same_as_eager(got["losses"], got["state"], want_losses, want_state, what)


def test_large_mean_one_process():
    _check(_train(0, 1, 1), 1, "batch norm, mean 1e4, one process")


def test_large_mean_deferred_one_process():
    _check(_train(0, 1, 2), 2, "deferred batch norm, mean 1e4, accumulation 2")


@pytest.mark.world
def test_large_mean_data_parallel():
    for rank, got in enumerate(run_world(_train, 2, 1)):
        _check(got, 1, f"sync batch norm, mean 1e4, data 2, rank {rank}")


@pytest.mark.world
def test_large_mean_deferred_data_parallel():
    for rank, got in enumerate(run_world(_train, 2, 2)):
        _check(got, 2, f"deferred sync batch norm, mean 1e4, data 2 x accumulation 2, rank {rank}")
