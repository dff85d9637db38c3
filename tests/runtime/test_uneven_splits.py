"""Uneven splits on real gloo processes equal eager PyTorch (docs/sbp.md, NOTE: Uneven splits).

split(d) of a dim that does not divide over the ranks gives rank k chunk k of torch.chunk
(8 x 3 split(1) over 2 ranks: 2 and 1 columns; 10 rows over 4 ranks: 3, 3, 3, 1). Each
config trains STEPS steps and compares the losses and the gathered state dict with eager
PyTorch on the whole batch, float64, tolerance 1e-10 (helpers.assert_same_as_eager):
  2 ranks: seed 003's 8x3 weight under a matmul; a column-parallel Linear(8, 3) feeding a
           row-parallel Linear(3, 4); vocabulary- and column-split embeddings; data
           parallel on a 5-row batch (gradient sync); accumulation 1 and 2; a checkpoint
           round trip (graphc.save / load) of the uneven shards;
  4 ranks (slow): 10 rows or columns over 4 ranks through the same ops, and a 14-row batch
           with accumulation 2 (shards 4, 4, 4, 2: 2, 2, 2, 1 per micro-batch); data x
           tensor on a 2 x 2 mesh, 5 rows over the data axis and 3 hidden over the tensor
           axis (each tensor column's gradient all-reduced in its own shape); 7 rows split
           by both axes of the mesh (2, 2, 2, 1) and gathered for an op without a rule.
"""
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from graphc.sbp.layout import local_component
from helpers import assert_same_as_eager, run_world

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

STEPS = 3


class MatmulNet(nn.Module):
    """Seed 003's stage 1: out = x @ w with w [8, n] split(1)."""

    def __init__(self, cols):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, cols))

    def forward(self, x):
        return torch.matmul(x, self.w)


class LinearNet(nn.Module):
    """Megatron's pair with an uneven hidden size: fc1 column-parallel, fc2 row-parallel."""

    def __init__(self, hidden):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, hidden), nn.Linear(hidden, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class EmbedNet(nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, 4)

    def forward(self, idx):
        return self.head(self.emb(idx)).mean(1)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class NestedNet(MLP):
    """logcumsumexp has no SBP rule: on a batch split by both mesh axes its input is gathered,
    innermost axis first (axis 1 cuts each of axis 0's shards)."""

    def forward(self, x):
        return self.fc2(torch.logcumsumexp(torch.relu(self.fc1(x)), 1) / 16)


class TrainGraph(graphc.Graph):
    def __init__(self, model, accumulation):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def build(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def _declare(model, kind, where):
    """The layouts of each config: `kind` names the split parameters. On the 2 x 2 mesh they
    split along axis 1 (tensor) and are broadcast along axis 0 (data)."""
    on = (lambda s: (sbp.broadcast, s)) if kind in ("mesh", "nested") else (lambda s: s)
    graphc.to_global(model, placement=where, sbp=on(sbp.broadcast))
    linear = {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1}
    split = {"matmul": {"w": 1}, "linear": linear, "mesh": linear, "vocab": {"emb.weight": 0},
             "columns": {"emb.weight": 1}, "data": {}, "nested": {}}[kind]
    params = dict(model.named_parameters())
    for name, dim in split.items():
        graphc.to_global(params[name], placement=where, sbp=on(sbp.split(dim)))


def _batch(kind, rows, step, vocab=0):
    g = torch.Generator().manual_seed(100 + step)
    if kind in ("vocab", "columns"):
        return torch.randint(0, vocab, (rows, 3), generator=g), torch.randn(rows, 4, generator=g)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)


def _model(kind, size):
    torch.manual_seed(0)
    return {"matmul": lambda: nn.Sequential(MatmulNet(size), nn.Linear(size, 4)),
            "linear": lambda: LinearNet(size), "mesh": lambda: LinearNet(size),
            "vocab": lambda: EmbedNet(size, 6),
            "columns": lambda: EmbedNet(7, size), "data": MLP, "nested": NestedNet}[kind]()


def _declare_any(model, kind, where):
    _declare(model[0] if kind == "matmul" else model, kind, where)
    if kind == "matmul":
        graphc.to_global(model[1], placement=where, sbp=sbp.broadcast)


def _feed(kind, x, y, where, rank):
    """A data-parallel config splits the batch (each rank its chunk, the global shape given),
    on the mesh along axis 0; the others pass it whole."""
    if kind not in ("data", "mesh", "nested"):
        return x, y
    rows = {"data": (sbp.split(0),), "mesh": (sbp.split(0), sbp.broadcast),
            "nested": (sbp.split(0), sbp.split(0))}[kind]
    return tuple(graphc.to_global(local_component(t, rows, where.ranks, rank), placement=where,
                                  sbp=rows, shape=t.shape) for t in (x, y))


def _run_config(rank, world, kind, size, rows, accumulation):
    where = graphc.placement("cpu", [[0, 1], [2, 3]] if kind in ("mesh", "nested")
                             else list(range(world)))
    model = _model(kind, size)
    _declare_any(model, kind, where)
    graph = TrainGraph(model, accumulation)
    losses = []
    for step in range(STEPS):
        x, y = _batch(kind, rows, step, size if kind == "vocab" else 7)
        losses.append(graph(*_feed(kind, x, y, where, rank)).to_local().item())
    shards = {k: tuple(v.shape) for k, v in (*model.named_parameters(), *model.named_buffers())}
    return {"losses": losses, "state": graph.full_state_dict(), "shards": shards,
            "plan": str(graph.plan)}


def _eager(kind, size, rows):
    model = _model(kind, size)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = _batch(kind, rows, step, size if kind == "vocab" else 7)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# (kind, size of the split dim, batch rows, accumulation)
CONFIGS = {
    2: [("matmul", 3, 4, 1), ("matmul", 3, 4, 2), ("linear", 3, 4, 1), ("linear", 3, 4, 2),
        ("vocab", 5, 4, 2), ("columns", 3, 4, 1), ("data", 0, 5, 1)],
    4: [("matmul", 10, 4, 2), ("linear", 10, 4, 1), ("vocab", 10, 4, 2), ("data", 0, 10, 1),
        ("data", 0, 14, 2), ("mesh", 3, 5, 1), ("nested", 0, 7, 1)],
}


def _train(rank, world):
    out = {cfg: _run_config(rank, world, *cfg) for cfg in CONFIGS[world]}
    if world == 2:
        out["checkpoint"] = _checkpoint_round_trip(rank, world)
    return out


def _check(results, world):
    for cfg in CONFIGS[world]:
        kind, size, rows, _ = cfg
        ref_losses, ref_state = _eager(kind, size, rows)
        for rank, got in enumerate(results):
            r = got[cfg]
            assert_same_as_eager(r["losses"], r["state"], ref_losses, ref_state,
                                 f"world={world} {cfg} rank {rank}")


def test_uneven_splits_match_eager_on_2_ranks():
    results = run_world(_train, 2)
    _check(results, 2)
    # the seed's 8 x 3 weight: rank 0 holds 2 columns, rank 1 one; gradients stay split
    assert [r[("matmul", 3, 4, 1)]["shards"]["0.w"] for r in results] == [(8, 2), (8, 1)]
    assert [r[("linear", 3, 4, 2)]["shards"]["fc1.bias"] for r in results] == [(2,), (1,)]
    assert [r[("vocab", 5, 4, 2)]["shards"]["emb.weight"] for r in results] == [(3, 6), (2, 6)]
    # data parallel on 5 rows: 3 and 2 per rank, gradients all-reduced (full shapes)
    assert "ALL_REDUCE ranks=[0, 1]" in results[0][("data", 0, 5, 1)]["plan"]
    ref_losses, ref_state = _eager("linear", 3, 4)
    for rank, got in enumerate(results):
        losses, state = got["checkpoint"]
        assert_same_as_eager(losses, state, ref_losses, ref_state, f"checkpoint rank {rank}")


@pytest.mark.slow  # a 4-rank world (CI time): run with -m slow
def test_ten_rows_over_four_ranks_match_eager():
    results = run_world(_train, 4)
    _check(results, 4)
    assert [r[("linear", 10, 4, 1)]["shards"]["fc1.weight"][0] for r in results] == [3, 3, 3, 1]
    assert [r[("vocab", 10, 4, 2)]["shards"]["emb.weight"][0] for r in results] == [3, 3, 3, 1]
    assert [r[("mesh", 3, 5, 1)]["shards"]["fc1.weight"][0] for r in results] == [2, 1, 2, 1]


# -- checkpoints ---------------------------------------------------------------------------
def _checkpoint_round_trip(rank, world):
    """One step, save every rank's shards, a fresh graph (other initial values) loads them and
    trains on: the same as eager training without a break."""
    import tempfile
    where = graphc.placement("cpu", list(range(world)))
    model = _model("linear", 3)
    _declare_any(model, "linear", where)
    graph = TrainGraph(model, 2)
    x, y = _batch("linear", 4, 0)
    losses = [graph(x, y).to_local().item()]
    path = os.path.join(tempfile.gettempdir(), f"graphc-uneven-{os.environ['MASTER_PORT']}-{rank}.pt")
    graphc.save(graph.state_dict(), path)
    torch.manual_seed(1)
    fresh = LinearNet(3)
    _declare_any(fresh, "linear", where)
    resumed = TrainGraph(fresh, 2)
    resumed.load_state_dict(graphc.load(path))
    os.remove(path)
    for step in range(1, STEPS):
        x, y = _batch("linear", 4, step)
        losses.append(resumed(x, y).to_local().item())
    return losses, resumed.full_state_dict()
