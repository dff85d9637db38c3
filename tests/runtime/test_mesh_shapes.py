"""Pipeline stages whose meshes differ in shape (a 2-D stage next to a 1-D one).

A layout carries over axis by axis only between meshes of one shape; between others a
value moves in pieces (the n-to-m transfer of docs/sbp.md, NOTE: Reshard pieces). Numerics: float64,
the oracle of helpers.py (eager PyTorch on the whole batch within 1e-10), on 5 gloo ranks:
  2d_then_1d: stage 0 data x tensor parallel on [[0, 1], [2, 3]], stage 1 on [4];
  1d_then_2d: stage 0 on [0], stage 1 tensor parallel on [[1, 2], [3, 4]], 2 micro-batches.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from graphc.plan.instructions import Collective, Send
from helpers import assert_same_as_eager, compile_graph, eager_train, global_input, run_world
from models import OPTIMIZERS

STEPS, D, CLASSES, BATCH = 3, 8, 4, 8
B = sbp.broadcast


class MLP(nn.Module):
    """fc1 column-parallel and fc2 row-parallel on a mesh axis (Megatron)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x):
        return torch.tanh(x + self.fc2(F.gelu(self.fc1(x))))


class Net(nn.Module):
    def __init__(self, first_mlp: bool):
        super().__init__()
        self.first_mlp = first_mlp
        self.stage0 = MLP() if first_mlp else nn.Linear(D, D)
        self.stage1 = nn.Linear(D, CLASSES) if first_mlp else nn.Sequential(MLP(), nn.Linear(D, CLASSES))

    def forward(self, x):
        return self.stage1(self.stage0(x))


class TrainGraph(graphc.Graph):
    def __init__(self, model, p0, p1, acc):
        super().__init__()
        self.model = model
        self.model.stage0.config.set_stage(0, p0)
        self.model.stage1.config.set_stage(1, p1)
        self.config.set_gradient_accumulation_steps(acc)
        self.add_optimizer(OPTIMIZERS["adam"](model.parameters()))

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


MESH_A = graphc.placement("cpu", [[0, 1], [2, 3]])
MESH_B = graphc.placement("cpu", [[1, 2], [3, 4]])


def _megatron_on_axis_1(mlp: nn.Module, mesh) -> None:
    graphc.to_global(mlp, placement=mesh, sbp=(B, B))
    graphc.to_global(mlp.fc1, placement=mesh, sbp=(B, sbp.split(0)))
    graphc.to_global(mlp.fc2.weight, placement=mesh, sbp=(B, sbp.split(1)))


def _two_d_then_one_d(rank):
    model = Net(first_mlp=True)
    _megatron_on_axis_1(model.stage0, MESH_A)
    graph = TrainGraph(model, MESH_A, graphc.placement("cpu", [4]), 1)
    row = rank // 2 if rank < 4 else 0  # this rank's data-parallel shard on mesh axis 0

    def feed(x, y):  # accumulation 1: the split x and the whole y group rows alike
        return graphc.to_global(x.chunk(2)[row], placement=MESH_A, sbp=(sbp.split(0), B)), y
    return model, graph, feed


def _one_d_then_two_d(rank):
    model = Net(first_mlp=False)
    _megatron_on_axis_1(model.stage1[0], MESH_B)
    graphc.to_global(model.stage1[1], placement=MESH_B, sbp=(B, B))
    graph = TrainGraph(model, graphc.placement("cpu", [0]), MESH_B, 2)
    return model, graph, lambda x, y: (x, y)


CONFIGS = {"2d_then_1d": (_two_d_then_one_d, True), "1d_then_2d": (_one_d_then_two_d, False)}


def batches(seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, D, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
            for _ in range(STEPS)]


def _train(rank, world):
    out = {}
    for name, (setup, _) in CONFIGS.items():
        torch.manual_seed(0)
        _, graph, feed = setup(rank)
        losses = [graph(*feed(x, y)).to_local() for x, y in batches()]
        out[name] = {"losses": [l.item() for l in losses if l.numel()],
                     "state": graph.full_state_dict()}
    return out


@pytest.mark.world
@pytest.mark.slow   # CI time: 2-D stage meshes run in the local sweep (gpt-pp2-dp2-tp2..., tests/local)
def test_2d_and_1d_stages_match_eager():
    results = run_world(_train, 5)
    for name, (_, first_mlp) in CONFIGS.items():
        torch.manual_seed(0)
        ref_losses, ref_state = eager_train(Net(first_mlp), OPTIMIZERS["adam"], None,
                                            lambda out, y: F.cross_entropy(out, y), batches(), STEPS)
        for rank, res in enumerate(results):
            got = res[name]
            assert_same_as_eager(got["losses"], got["state"], ref_losses if got["losses"] else [],
                                 ref_state, f"{name} rank {rank}")
        assert results[4][name]["losses"], f"{name}: the loss's stage runs on rank 4"


def test_equal_sized_meshes_of_other_shapes_exchange_pieces():
    """[[0, 1], [2, 3]] then [4, 5, 6, 7]: 4 ranks each, but split(0) on a 2x2 mesh's rows is
    not split(0) over 4 ranks, so the activation moves in pieces (NOTE: Reshard pieces): of
    the 4 rows ranks 0 and 1 both hold, rank 4 takes rows 0-1 from rank 0 and rank 5 rows 2-3
    from rank 1; nothing is gathered first and nothing crosses whole."""
    torch.manual_seed(0)
    model = Net(first_mlp=True)
    _megatron_on_axis_1(model.stage0, MESH_A)
    graph = TrainGraph(model, MESH_A, graphc.placement("cpu", [4, 5, 6, 7]), 1)
    x, y = batches()[0]
    compiled = compile_graph(graph, [global_input(x, MESH_A, (sbp.split(0), B)), y], 8)
    for rank, peer in ((0, 4), (1, 5), (2, 6), (3, 7)):
        plan = compiled.plan_for(rank)
        sends = [(ins.peer, tuple(t.shape)) for ins in plan.instructions
                 if isinstance(ins, Send) and ins.direction == "F" for t in ins.tensors]
        assert sends == [(peer, (BATCH // 4, D))], (rank, sends)
        gathers = [ins for ins in plan.instructions if isinstance(ins, Collective)
                   and ins.op == "all_gather"]
        assert not gathers, str(plan)
