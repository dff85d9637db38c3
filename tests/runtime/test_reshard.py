"""n-to-m transfers in pieces: between stages whose meshes differ in shape, each receiver gets
only the rows it needs (NOTE: Reshard pieces in graphc/sbp/pieces.py), with gradient
accumulation 2, against eager PyTorch on the whole batch (float64, helpers.py's oracle):

  2_to_3:  stage 0 data parallel on [0, 1], stage 1 on [2, 3, 4]
  3_to_2:  stage 0 data parallel on [0, 1, 2], stage 1 on [3, 4]
  2x2_to_2: stage 0 data x tensor parallel on [[0, 1], [2, 3]], stage 1 on [4, 5]

x and y are split(0) over stage 0's data-parallel axis (so micro-batch k holds every rank's
k-th chunk of both, and they group rows alike); y lives on stage 0 (its placement, see
graphc/passes/place_inputs.py) and travels to the loss with the activations. The loss is a
mean squared error: a cross-entropy's targets would have to sit on the loss's stage, where
graphc counts them before the micro-batches run.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import compiler, sbp
from graphc.plan.instructions import Recv, Send
from helpers import assert_same_as_eager, eager_train, run_world
from models import OPTIMIZERS

STEPS, D, H, CLASSES, BATCH, ACC = 3, 4, 8, 3, 12, 2
B, S0 = sbp.broadcast, sbp.split(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(x + self.fc2(F.gelu(self.fc1(x)))))


class TrainGraph(graphc.Graph):
    def __init__(self, model, p0, p1):
        super().__init__()
        self.model = model
        self.model.fc1.config.set_stage(0, p0)
        self.model.fc2.config.set_stage(0, p0)
        self.model.head.config.set_stage(1, p1)
        self.config.set_gradient_accumulation_steps(ACC)
        self.add_optimizer(OPTIMIZERS["adam"](model.parameters()))

    def build(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def _one_d(ranks0, ranks1):
    def setup(rank):
        model = Net()
        p0, p1 = graphc.placement("cpu", ranks0), graphc.placement("cpu", ranks1)
        k = ranks0.index(rank) if rank in ranks0 else 0

        def feed(x, y):
            n = len(ranks0)
            return (graphc.to_global(x.chunk(n)[k], placement=p0, sbp=S0),
                    graphc.to_global(y.chunk(n)[k], placement=p0, sbp=S0))
        return model, TrainGraph(model, p0, p1), feed
    return setup


MESH = graphc.placement("cpu", [[0, 1], [2, 3]])


def _two_d(rank):
    model = Net()
    graphc.to_global(model.fc1, placement=MESH, sbp=(B, S0))           # column-parallel
    graphc.to_global(model.fc2.weight, placement=MESH, sbp=(B, sbp.split(1)))  # row-parallel
    graphc.to_global(model.fc2.bias, placement=MESH, sbp=(B, B))
    row = rank // 2 if rank < 4 else 0

    def feed(x, y):
        return (graphc.to_global(x.chunk(2)[row], placement=MESH, sbp=(S0, B)),
                graphc.to_global(y.chunk(2)[row], placement=MESH, sbp=(S0, B)))
    return model, TrainGraph(model, MESH, graphc.placement("cpu", [4, 5])), feed


CONFIGS = {"2_to_3": (_one_d([0, 1], [2, 3, 4]), 5),
           "3_to_2": (_one_d([0, 1, 2], [3, 4]), 5),
           "2x2_to_2": (_two_d, 6)}


def batches(seed=5):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, D, generator=g), torch.randn(BATCH, CLASSES, generator=g))
            for _ in range(STEPS)]


def _train(rank, world, name):
    torch.manual_seed(0)
    _, graph, feed = CONFIGS[name][0](rank)
    losses = [graph(*feed(x, y)).to_local() for x, y in batches()]
    return {"losses": [l.item() for l in losses if l.numel()], "state": graph.full_state_dict()}


@pytest.mark.world
@pytest.mark.parametrize("name", ["2_to_3", pytest.param("3_to_2", marks=pytest.mark.slow),
                                  pytest.param("2x2_to_2", marks=pytest.mark.slow)])   # CI time
def test_n_to_m_in_pieces_matches_eager(name):
    results = run_world(_train, CONFIGS[name][1], name)
    torch.manual_seed(0)
    ref_losses, ref_state = eager_train(Net(), OPTIMIZERS["adam"], None,
                                        F.mse_loss, batches(), STEPS)
    assert any(r["losses"] for r in results), "no rank returned the loss"
    for rank, got in enumerate(results):
        assert_same_as_eager(got["losses"], got["state"], ref_losses if got["losses"] else [],
                             ref_state, f"{name} rank {rank}")


def _compiled(name):
    world = CONFIGS[name][1]
    model, graph, feed = CONFIGS[name][0](0)
    x, y = feed(*batches()[0])
    return compiler.compile(graph, [torch.empty(BATCH, D), torch.empty(BATCH, CLASSES)],
                            world, [(x.placement, x.sbp), (y.placement, y.sbp)])


def test_two_to_three_moves_only_the_rows_each_receiver_needs():
    """Micro-batch of 6 rows, 3 + 3 on [0, 1], 2 + 2 + 2 on [2, 3, 4]: rank 2 takes rows 0-1
    from rank 0, rank 3 row 2 from rank 0 and row 3 from rank 1, rank 4 rows 4-5 from rank 1;
    the gradients go back the same way. No value crosses whole, nothing is gathered first."""
    compiled = _compiled("2_to_3")
    rows = {}
    for rank in range(5):
        for ins in compiled.plan_for(rank).instructions:
            if isinstance(ins, Recv) and ins.microbatch == 0:
                for t in ins.tensors:
                    rows.setdefault((ins.direction, t.name), {})[(ins.peer, rank)] = t.shape[0]
    acts = {k: v for k, v in rows.items() if k[0] == "F"}
    assert acts, "no activation crosses"
    for (_, name), got in acts.items():
        assert got == {(0, 2): 2, (0, 3): 1, (1, 3): 1, (1, 4): 2}, (name, got)
    grads = [v for k, v in rows.items() if k[0] == "B"]
    assert grads and all(g == {(2, 0): 2, (3, 0): 1, (3, 1): 1, (4, 1): 2} for g in grads), grads
    plan0 = compiled.plan_for(0)
    assert not [i for i in plan0.instructions if "all_gather" in str(i)], str(plan0)


def test_pieces_print_where_they_sit_and_parse_back():
    plan = _compiled("3_to_2").plan_for(3)
    text = str(plan)
    assert "@" in text and "/" in text, text
    assert str(type(plan).parse(text)) == text
    sends = [t for ins in _compiled("3_to_2").plan_for(1).instructions if isinstance(ins, Send)
             and ins.direction == "F" for t in ins.tensors]
    assert {t.shape[0] for t in sends} == {1}, sends   # rank 1 holds rows 2-3: one to each


class Encoder(nn.Module):
    """PyTorch's own TransformerEncoderLayer (not written for graphc) and a head."""

    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.enc(x))


class EncoderGraph(graphc.Graph):
    def __init__(self, model, p0, p1):
        super().__init__()
        self.model = model
        self.model.enc.config.set_stage(0, p0)
        self.model.head.config.set_stage(1, p1)
        self.config.set_gradient_accumulation_steps(ACC)
        self.add_optimizer(OPTIMIZERS["adam"](model.parameters()))

    def build(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def sequences(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 5, 8, generator=g), torch.randn(BATCH, 5, 3, generator=g))
            for _ in range(2)]


def _train_encoder(rank, world):
    torch.manual_seed(0)
    p0, p1 = graphc.placement("cpu", [0, 1]), graphc.placement("cpu", [2, 3, 4])
    graph = EncoderGraph(Encoder(), p0, p1)
    k = rank if rank < 2 else 0
    losses = [graph(graphc.to_global(x.chunk(2)[k], placement=p0, sbp=S0),
                    graphc.to_global(y.chunk(2)[k], placement=p0, sbp=S0)).to_local()
              for x, y in sequences()]
    return {"losses": [l.item() for l in losses if l.numel()], "state": graph.full_state_dict()}


@pytest.mark.world
@pytest.mark.slow   # CI time: the 2_to_3 layout runs above, torch's encoder layer in tests/examples
def test_torch_transformer_encoder_layer_2_to_3_matches_eager():
    results = run_world(_train_encoder, 5)
    torch.manual_seed(0)
    ref_losses, ref_state = eager_train(Encoder(), OPTIMIZERS["adam"], None, F.mse_loss,
                                        sequences(), 2)
    assert any(r["losses"] for r in results), "no rank returned the loss"
    for rank, got in enumerate(results):
        assert_same_as_eager(got["losses"], got["state"], ref_losses if got["losses"] else [],
                             ref_state, f"encoder rank {rank}")
