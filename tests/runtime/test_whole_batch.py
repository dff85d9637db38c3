"""Programs whose meaning depends on the whole batch train exactly like eager PyTorch.

  - a token-mean loss with ignore_index (and class weights, label smoothing) under
    accumulation 2 and 4 on a 2-stage pipeline, with labels whose micro-batches hold
    different numbers of ignored tokens: eager divides by the whole batch's count
    (torchtitan #2972), so must graphc; the returned loss is eager's loss;
  - an input without a batch dim (class prototypes P [C, d] used as x @ P.T, C not
    divisible by the accumulation) is passed whole to every micro-batch;
  - an in-batch contrastive loss (z @ z.T) trains like eager with accumulation 1 (with
    accumulation 2 it is refused: tests/passes/test_find_batch_dims.py).
Float64, tolerance 1e-10 (the oracle of helpers.py).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc.meta import META_BATCHED
from helpers import assert_same_as_eager, eager_train, run_world

STEPS = 3
B, T, D, C = 16, 3, 8, 5


def class_weight():  # made when called: spawned ranks set the default dtype after importing us
    return torch.tensor([1.0, 0.5, 2.0, 1.5, 0.25])


class TwoStages(nn.Module):
    def __init__(self, d_out=C):
        super().__init__()
        self.stage0 = nn.Sequential(nn.Linear(D, D), nn.Tanh())
        self.stage1 = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, d_out))

    def forward(self, x):
        return self.stage1(self.stage0(x))


class WholeBatchGraph(graphc.Graph):
    """stage0 on rank 0, stage1 (and the loss) on rank 1; `loss` picks build()'s loss."""

    def __init__(self, model, opt, accumulation, loss):
        super().__init__()
        self.model = model
        self.model.stage0.config.set_stage(0, graphc.placement("cpu", [0]))
        self.model.stage1.config.set_stage(1, graphc.placement("cpu", [1]))
        self.loss_fn = nn.CrossEntropyLoss()
        self.loss, self.weight = loss, class_weight()
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(opt)

    def build(self, x, *rest):
        if self.loss == "module":       # nn.CrossEntropyLoss, ignore_index=-100 by default
            loss = self.loss_fn(self.model(x).flatten(0, 1), rest[0].flatten())
        elif self.loss == "functional":  # class weights, label smoothing, another ignore_index
            loss = F.cross_entropy(self.model(x).flatten(0, 1), rest[0].flatten(), weight=self.weight,
                                   ignore_index=7, label_smoothing=0.1)
        elif self.loss == "prototypes":
            loss = prototype_loss(self.model(x), *rest)
        else:
            loss = contrastive_loss(self.model(x))
        loss.backward()
        return loss


def prototype_loss(h, prototypes, y):
    return F.cross_entropy(h @ prototypes.T, y)


def contrastive_loss(h):
    z = F.normalize(h, dim=1)
    return F.cross_entropy(z @ z.T / 0.5, torch.arange(z.shape[0]))


def token_batches(ignore: int):
    """Labels [B, T] where each quarter of the batch ignores a different number of tokens."""
    g = torch.Generator().manual_seed(7)
    out = []
    for step in range(STEPS):
        x = torch.randn(B, T, D, generator=g)
        y = torch.randint(0, C, (B, T), generator=g)
        for q, n in enumerate((9, 1, 5, 0)):  # ignored tokens per quarter (of 12)
            y[4 * q:4 * q + 4].view(-1)[torch.randperm(12, generator=g)[:n]] = ignore
        out.append((x, y))
    return out


def prototype_batches():
    g = torch.Generator().manual_seed(8)
    protos = torch.randn(C, D, generator=g)
    return [(torch.randn(B, D, generator=g), protos, torch.randint(0, C, (B,), generator=g))
            for _ in range(STEPS)]


def contrastive_batches():
    g = torch.Generator().manual_seed(9)
    return [(torch.randn(B, D, generator=g),) for _ in range(STEPS)]


CASES = {  # name: (loss, accumulation, batches, model's output width)
    "module acc 2": ("module", 2, lambda: token_batches(-100), C),
    "module acc 4": ("module", 4, lambda: token_batches(-100), C),
    "functional acc 2": ("functional", 2, lambda: token_batches(7), C),
    "functional acc 4": ("functional", 4, lambda: token_batches(7), C),
    "prototypes acc 2": ("prototypes", 2, prototype_batches, D),
    "contrastive acc 1": ("contrastive", 1, contrastive_batches, D),
}


def _sgd(params):
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)


def _train(rank, world):
    out = {}
    for name, (loss, acc, batches, width) in CASES.items():
        torch.manual_seed(0)
        model = TwoStages(width)
        graph = WholeBatchGraph(model, _sgd(model.parameters()), acc, loss)
        losses = [graph(*batch).to_local() for batch in batches()]
        out[name] = {"losses": [l.item() for l in losses if l.numel()],
                     "state": graph.full_state_dict(), "printed": str(graph),
                     "split": [n.meta[META_BATCHED] for n in graph.compiled.gm.graph.nodes
                               if n.op == "placeholder"]}
    return out


def _eager_loss(loss: str):
    if loss == "module":
        return lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())
    if loss == "functional":
        return lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten(), weight=class_weight(),
                                              ignore_index=7, label_smoothing=0.1)
    if loss == "prototypes":
        return lambda out, rest: prototype_loss(out, *rest)
    return lambda out, _: contrastive_loss(out)


def _eager_batches(loss: str, batches):
    if loss == "prototypes":
        return [(x, (p, y)) for x, p, y in batches]
    if loss == "contrastive":
        return [(x, None) for (x,) in batches]
    return batches


@pytest.mark.world
def test_whole_batch_semantics_match_eager():
    results = run_world(_train, 2)
    for name, (loss, acc, batches, width) in CASES.items():
        torch.manual_seed(0)
        ref_losses, ref_state = eager_train(TwoStages(width), _sgd, None, _eager_loss(loss),
                                            _eager_batches(loss, batches()), STEPS)
        for rank in range(2):
            got = results[rank][name]
            assert_same_as_eager(got["losses"], got["state"], ref_losses if rank == 1 else [],
                                 ref_state, f"{name}, rank {rank}")
    assert results[1]["prototypes acc 2"]["split"] == [True, False, True]  # x, prototypes, y
    assert "prologue" in results[1]["module acc 4"]["printed"]


def test_per_microbatch_means_would_differ():
    """The labels above make the bug visible: a mean of micro-batch means is not eager's."""
    for ignore, kw in ((-100, {}), (7, {"weight": class_weight(), "ignore_index": 7})):
        x, y = token_batches(ignore)[0]
        logits = torch.randn(B, T, C, generator=torch.Generator().manual_seed(1))
        whole = F.cross_entropy(logits.flatten(0, 1), y.flatten(), **kw)
        for m in (2, 4):
            per_mb = torch.stack([F.cross_entropy(lo.flatten(0, 1), t.flatten(), **kw)
                                  for lo, t in zip(logits.chunk(m), y.chunk(m))]).mean()
            assert abs(per_mb - whole) > 1e-3, (ignore, m)


class DataParallelGraph(graphc.Graph):
    def __init__(self, model, opt, loss):
        super().__init__()
        self.model = model
        self.loss_fn = nn.CrossEntropyLoss()
        self.loss, self.weight = loss, class_weight()
        self.config.set_gradient_accumulation_steps(2)
        self.add_optimizer(opt)

    def build(self, x, y):
        if self.loss == "module":
            loss = self.loss_fn(self.model(x).flatten(0, 1), y.flatten())
        else:
            loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten(), weight=self.weight,
                                   ignore_index=7, label_smoothing=0.1)
        loss.backward()
        return loss


def _train_data_parallel(rank, world):
    where = graphc.placement("cpu", [0, 1])
    out = {}
    for loss, ignore in (("module", -100), ("functional", 7)):
        torch.manual_seed(0)
        model = graphc.to_global(TwoStages(), placement=where, sbp=graphc.sbp.broadcast)
        graph = DataParallelGraph(model, _sgd(model.parameters()), loss)
        losses = []
        for x, y in token_batches(ignore):  # rank r holds rows [8r, 8r + 8): two quarters
            x, y = (graphc.to_global(t.chunk(2)[rank], placement=where, sbp=graphc.sbp.split(0))
                    for t in (x, y))
            losses.append(graph(x, y).to_local().item())
        out[loss] = {"losses": losses, "state": graph.full_state_dict(), "printed": str(graph)}
    return out


@pytest.mark.world
def test_token_mean_data_parallel_matches_eager():
    """2 ranks x 2 micro-batches: the count sums over micro-batches, then over the ranks."""
    results = run_world(_train_data_parallel, 2)
    for loss, ignore in (("module", -100), ("functional", 7)):
        torch.manual_seed(0)
        ref_losses, ref_state = eager_train(TwoStages(), _sgd, None, _eager_loss(loss),
                                            token_batches(ignore), STEPS)
        for rank in range(2):
            got = results[rank][loss]
            assert_same_as_eager(got["losses"], got["state"], ref_losses, ref_state,
                                 f"data parallel {loss}, rank {rank}")
            assert "prologue" in got["printed"]
