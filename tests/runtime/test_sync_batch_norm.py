"""Data-parallel conv nets with BatchNorm: no fallback, and eager's numbers (sync-BN).

Plan level (one process, a world of 2): a ResNet-style net (tests/conv_models.py) on a
split(0) batch has an SBP rule for every op (nothing gathered to broadcast); each
BatchNorm in training costs two all-reduces forward (its per-channel sums, then its
statistics about the batch mean) and one backward, and in eval mode none.
Numerics: data parallel 2, and pipeline 2 x data parallel 2 on 4 ranks, train like eager
PyTorch on the whole batch (BatchNorm normalises with the global batch's statistics),
float64, tolerance 1e-10 (the oracle of helpers.py); the running statistics (momentum 0.1
and momentum=None) and num_batches_tracked equal eager's on every rank.
"""
import pytest
import torch
import torch.nn as nn

import graphc
from graphc import sbp
from graphc.meta import META_SBP
from graphc.plan.instructions import AllReduce, Collective, OutputAllReduce
from graphc.sbp import local_ops
from conv_models import ConvNet
from helpers import (assert_close, assert_same_as_eager, compile_graph, eager_train, global_input,
                     graphc_train, run_world)
from models import OPTIMIZERS

STEPS = 3
BATCH, CLASSES = 8, 5
P01 = graphc.placement("cpu", [0, 1])
P23 = graphc.placement("cpu", [2, 3])


class ConvGraph(graphc.Graph):
    def __init__(self, model, opt=None, stages=()):
        super().__init__()
        self.model = model
        for name, sid, where in stages:
            getattr(self.model, name).config.set_stage(sid, where)
        self.loss_fn = nn.CrossEntropyLoss()
        if opt is not None:
            self.add_optimizer(opt)
        self.training = opt is not None

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        if self.training:
            loss.backward()
        return loss


def _batches(n=STEPS):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, 3, 8, 8, generator=g) * 2 + 1,
             torch.randint(0, CLASSES, (BATCH,), generator=g)) for _ in range(n)]


def _compile_data_parallel(train: bool):
    model = graphc.to_global(ConvNet(), placement=P01, sbp=sbp.broadcast)
    model.train(train)
    graph = ConvGraph(model, torch.optim.SGD(model.parameters(), lr=0.1) if train else None)
    x, y = _batches(1)[0]
    return compile_graph(graph, [global_input(x, P01, sbp.split(0)), global_input(y, P01, sbp.split(0))], 2)


def test_data_parallel_conv_net_has_no_fallback_and_few_all_reduces_per_batch_norm():
    cg = _compile_data_parallel(train=True)
    nodes = [n for n in cg.gm.graph.nodes if META_SBP in n.meta]
    assert not [n.name for n in nodes if n.meta[META_SBP].fallback]
    assert not [n.name for n in cg.gm.graph.nodes if n.op == "call_module"]  # all rewritten
    norms = [n for n in nodes if "batch_norm_stats" in n.name]
    assert len(norms) == 7
    comms = [i for i in cg.plans[0].instructions if isinstance(i, Collective)]
    assert {i.kind for i in comms} == {"all_reduce"}  # never an all-gather of activations
    forward = [i for i in comms if i.direction == "F"]
    backward = [i for i in comms if i.direction == "B"]
    assert len(forward) == 2 * len(norms)  # sums, statistics (the loss's partial sum: once per step)
    assert len([i for i in cg.plans[0].instructions if isinstance(i, OutputAllReduce)]) == 1
    assert len(backward) == len(norms)
    grads = [t.name for i in cg.plans[0].instructions if type(i) is AllReduce for t in i.tensors]
    assert "model.layer1.bn1.weight" in grads and "model.stem.0.weight" in grads


@pytest.mark.fp32
def test_sync_batch_norm_input_gradient_sums_to_zero_at_large_mean():
    """The gradient a BatchNorm passes to its input sums to 0 over each channel (exactly, in
    real arithmetic); a layer before on inputs ~ 100 multiplies what is left by 100. Two
    shards of x = 100 + N(0,1) in float32, their statistics summed as the all-reduce does:
    |sum dx| / sum |dx| measured 2.0e-8 (the shards' M2 merged by Chan's formula: 9.8e-7;
    eager F.batch_norm on the whole batch: 1.4e-6). Bound: 4 float32 eps (4.8e-7), the
    rounding of the sums alone (See NOTE: synchronised batch norm)."""
    g = torch.Generator().manual_seed(0)
    x = (100 + torch.randn(64, 8, generator=g, dtype=torch.float64)).float().requires_grad_()
    weights = torch.randn(64, 8, generator=g, dtype=torch.float64).float()
    shards = x.chunk(2)
    total = sum(local_ops.batch_norm_sum(s) for s in shards)
    stats = sum(local_ops.batch_norm_stats(s, total, 64) for s in shards)
    y = torch.cat([local_ops.batch_norm_apply(s, stats, 64) for s in shards])
    (dx,) = torch.autograd.grad((y * weights).sum(), x)
    residual = (dx.sum(0).abs() / dx.abs().sum(0)).max().item()
    assert residual <= 4 * torch.finfo(torch.float32).eps, f"sum of the input gradient {residual:.1e}"


def test_eval_batch_norm_needs_no_collective():
    cg = _compile_data_parallel(train=False)
    nodes = [n for n in cg.gm.graph.nodes if META_SBP in n.meta]
    assert not [n.name for n in nodes if n.meta[META_SBP].fallback]
    comms = [i for i in cg.plans[0].instructions if isinstance(i, Collective)]
    assert not comms   # the loss only, summed once per step:
    assert len([i for i in cg.plans[0].instructions if isinstance(i, OutputAllReduce)]) == 1


def _rows(t, k, n=2):
    return t.chunk(n)[k]


def _train(rank, world):
    torch.manual_seed(0)
    model = ConvNet()
    k = rank % 2
    if world == 2:
        graphc.to_global(model, placement=P01, sbp=sbp.broadcast)
        stages, (px, py) = (), (P01, P01)
    else:
        stages, (px, py) = (("stem", 0, P01), ("layer1", 0, P01), ("layer2", 1, P23)), (P01, P23)
    graph = ConvGraph(model, OPTIMIZERS["sgd_momentum"](model.parameters()), stages)
    # x lives where the stem runs and y where the loss does: rank r passes rows r % 2 of each
    losses, state = graphc_train(graph, _batches(), feed=lambda x, y: (
        graphc.to_global(_rows(x, k), placement=px, sbp=sbp.split(0)),
        graphc.to_global(_rows(y, k), placement=py, sbp=sbp.split(0))))
    local = {n: b.clone() for n, b in model.named_buffers()}
    return {"losses": losses, "state": state, "buffers": local,
            "stages": graph.plan.local_stages}


def _check(world):
    results = run_world(_train, world)
    torch.manual_seed(0)
    ref_losses, ref_state = eager_train(ConvNet(), OPTIMIZERS["sgd_momentum"], None,
                                        nn.CrossEntropyLoss(), _batches(), STEPS)
    for rank, got in enumerate(results):
        what = f"conv net, {world} ranks, rank {rank}"
        assert_same_as_eager(got["losses"], got["state"], ref_losses if got["losses"] else [],
                             ref_state, what)
        for name, value in got["buffers"].items():  # the replicas' own running statistics
            owned = world == 2 or (name.startswith(("stem", "layer1")) == (got["stages"] == [0]))
            if owned:
                assert_close(value, ref_state[name], f"{what}: buffer {name}")


@pytest.mark.world
def test_data_parallel_batch_norm_matches_eager():
    _check(2)


@pytest.mark.world
@pytest.mark.slow   # CI time: data parallel BatchNorm runs by default, the sweep's convbn pp2 x dp2 in the local world
def test_pipeline_x_data_parallel_batch_norm_matches_eager():
    _check(4)
