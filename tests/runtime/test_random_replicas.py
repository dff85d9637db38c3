"""Random ops keep replicas equal (NOTE: Replica-equal randomness, graphc/ops/random_ops.py).

Tensor parallel 2 (real gloo processes, each rank's global RNG seeded differently after
the model is built, as a per-rank data order would): dropout on the broadcast residual and
on the head-split v and inside attention; after 3 steps every rank's replicated parameters
are bit-identical and the loss falls. Data parallel 2: the ranks' rows draw different masks,
a new step draws a new mask, and a graph compiled afresh from the same seed replays the
first step's. With p=0 both train exactly as eager PyTorch on the whole batch (float64,
1e-10, helpers.py).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from dropout_models import DropNet, tensor_parallel
from gpt_block_models import TokenLossGraph, token_loss
from helpers import assert_same_as_eager, eager_train, local_model_state, run_world

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

STEPS = 3
P01 = graphc.placement("cpu", [0, 1])


def _sgd(params):
    return torch.optim.SGD(params, lr=0.2)


def _token_batches():
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(4, 4, 6, generator=g), torch.randint(0, 5, (4, 4), generator=g)
    return [(x, y)] * STEPS  # one batch: the loss falls despite dropout


def _train_tp(rank, world):
    out = {}
    for p in (0.2, 0.0):
        torch.manual_seed(0)
        model = tensor_parallel(DropNet(p), P01)
        graph = TokenLossGraph(model, _sgd(model.parameters()))
        torch.manual_seed(1 + rank)  # each rank's own stream (its data order): replicas ignore it
        losses = [graph(x, y).to_local().item() for x, y in _token_batches()]
        out[p] = {"losses": losses, "state": graph.full_state_dict(),
                  # this rank's local components (a rank's own model refuses reads of the
                  # parts it holds: NOTE: Parameters held elsewhere)
                  "local": local_model_state(model)}
    return out


def test_tensor_parallel_dropout_keeps_replicas_equal():
    results = run_world(_train_tp, 2)
    drop = [r[0.2] for r in results]
    for k, v in drop[0]["state"].items():
        assert torch.equal(v, drop[1]["state"][k]), f"full_state_dict()[{k!r}] differs between ranks"
    replicated = [k for k in drop[0]["local"] if not k.startswith(("attn.q", "attn.k", "attn.v"))
                  and k != "attn.c_proj.weight"]
    assert {"inp.weight", "ln.weight", "attn.c_proj.bias", "head.weight"} <= set(replicated)
    for k in replicated:
        assert torch.equal(drop[0]["local"][k], drop[1]["local"][k]), f"replica {k!r} diverged"
    assert drop[0]["losses"][-1] < drop[0]["losses"][0], drop[0]["losses"]
    torch.manual_seed(0)
    ref_losses, ref_state = eager_train(DropNet(0.0), _sgd, None, token_loss, _token_batches(), STEPS)
    for rank, res in enumerate(results):
        assert_same_as_eager(res[0.0]["losses"], res[0.0]["state"], ref_losses, ref_state,
                             f"tensor parallel, p=0, rank {rank}")


class DropGraph(graphc.Graph):
    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.add_optimizer(opt)

    def build(self, x, y):
        h = self.model[0](x)
        loss = F.mse_loss(self.model[1](h), y)
        loss.backward()
        return loss, h


def _dp_batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 3, generator=g)) for _ in range(STEPS)]


def _train_dp(rank, world):
    out = {}
    for p in (0.5, 0.0):
        runs = []
        for _ in range(2):  # the second graph is compiled afresh: it must replay the first
            torch.manual_seed(0)
            model = graphc.to_global(nn.Sequential(nn.Dropout(p), nn.Linear(16, 3)), placement=P01,
                                     sbp=graphc.sbp.broadcast)
            graph = DropGraph(model, _sgd(model.parameters()))
            losses, masks = [], []
            for x, y in _dp_batches():
                loss, h = graph(*(graphc.to_global(t.chunk(world)[rank], placement=P01,
                                                   sbp=graphc.sbp.split(0)) for t in (x, y)))
                local_x = x.chunk(world)[rank]
                losses.append(loss.to_local().item())
                masks.append(h.to_local() != 0 if p else h.to_local() - local_x)
            runs.append({"losses": losses, "masks": masks, "state": graph.full_state_dict()})
        out[p] = runs
    return out


def test_data_parallel_dropout_draws_per_rank_and_replays():
    results = run_world(_train_dp, 2)
    first = [r[0.5][0] for r in results]
    for step in range(STEPS):
        assert not torch.equal(first[0]["masks"][step], first[1]["masks"][step]), \
            f"step {step}: both ranks' rows drew the same dropout mask"
    assert not torch.equal(first[0]["masks"][0], first[0]["masks"][1]), "a new step drew the same mask"
    for rank, res in enumerate(results):
        again = res[0.5][1]
        for step in range(STEPS):
            assert torch.equal(res[0.5][0]["masks"][step], again["masks"][step]), \
                f"rank {rank} step {step}: a graph compiled afresh drew another mask"
        for k, v in first[0]["state"].items():
            assert torch.equal(v, res[0.5][0]["state"][k]), f"rank {rank}: {k} differs from rank 0"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Dropout(0.0), nn.Linear(16, 3))
    ref_losses, ref_state = eager_train(model, _sgd, None, F.mse_loss, _dp_batches(), STEPS)
    for rank, res in enumerate(results):
        got = res[0.0][0]
        assert all(torch.equal(m, torch.zeros_like(m)) for m in got["masks"])
        assert_same_as_eager(got["losses"], got["state"], ref_losses, ref_state,
                             f"data parallel, p=0, rank {rank}")
