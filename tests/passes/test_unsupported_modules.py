"""unsupported_modules: check_runnable_module refuses a module exactly when torch itself would
refuse to run it on those inputs (today: nn.SyncBatchNorm training on cpu tensors once a
process group exists), and the refusal comes while tracing, naming the user's line, why and
the fix; everywhere else the module is left to run, and runs. One process: the process group
is a one-rank gloo group on an in-memory store (no ranks are spawned)."""
import os
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc.errors import GraphcError
from graphc.passes.unsupported_modules import check_runnable_module
from helpers import compile_graph

X = torch.randn(4, 8)


@contextmanager
def process_group(on: bool):
    """A one-rank gloo group, as every rank of a torchrun job has one, or none."""
    if on:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if on:
            dist.destroy_process_group()


def torch_refuses(module, x) -> bool:
    try:
        module(x)
    except ValueError as e:  # torch's own: "SyncBatchNorm expected input tensor to be on GPU"
        assert "SyncBatchNorm expected input tensor to be on GPU" in str(e)
        return True
    return False


def graphc_refuses(module, x) -> bool:
    try:
        check_runnable_module(module, (x,))
    except GraphcError:
        return True
    return False


@pytest.mark.parametrize("group", [False, True], ids=["no group", "group"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_refused_exactly_where_torch_refuses(group, training):
    bn = nn.SyncBatchNorm(8).train(training)
    with process_group(group):
        assert graphc_refuses(bn, X) == torch_refuses(bn, X) == (group and training)


def test_other_modules_are_left_to_run():
    with process_group(True):
        for module in (nn.BatchNorm1d(8), nn.Linear(8, 8), nn.LayerNorm(8)):
            check_runnable_module(module, (X,))
            assert module(X).shape == X.shape


def test_without_a_group_sync_batch_norm_is_a_batch_norm():
    """What graphc leaves to run does run: torch's SyncBatchNorm without a process group
    normalises like BatchNorm1d (batch statistics, the same running ones)."""
    sync, plain = nn.SyncBatchNorm(8), nn.BatchNorm1d(8)
    check_runnable_module(sync, (X,))
    torch.testing.assert_close(sync(X), plain(X), atol=0, rtol=0)
    torch.testing.assert_close(sync.running_var, plain.running_var, atol=0, rtol=0)


class Net(graphc.Graph):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 8), nn.SyncBatchNorm(8), nn.Linear(8, 2))
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))

    def build(self, x):
        loss = F.relu(self.model(x)).sum()  # LINE: call
        loss.backward()
        return loss


def test_the_refusal_comes_while_tracing_at_the_users_line():
    with open(__file__) as f:
        n = next(i for i, text in enumerate(f, 1) if text.rstrip().endswith("# LINE: call"))
    with process_group(True), pytest.raises(GraphcError) as info:
        compile_graph(Net(), [X], 1)
    msg = str(info.value)
    for fragment in ("a torch.nn.SyncBatchNorm(8) runs on a cpu placement at",
                     f"{os.path.abspath(__file__)}:{n}: loss = ", "torch's SyncBatchNorm needs CUDA",
                     "plain BatchNorm is sync-BN here", "set_deferred_batch_norm(True)",
                     "Fix: build the model with nn.BatchNorm1d/2d/3d"):
        assert fragment in msg, f"{fragment!r} not in:\n{msg}"


def test_without_a_group_the_same_graph_compiles():
    assert compile_graph(Net(), [X], 1).plans
