"""Item writes (`x[index] = value`) and named results (`torch.topk(...).values`) in build().

NOTE: Item writes (graphc/passes/traced_writes.py): a write is recorded as an out-of-place
set_item and the user's tensor points at its result. One process, float64, against eager
within 1e-10: each habit trains like eager at accumulation 1 and 2 (the inputs split into
micro-batches); a write eager would see through another view, a write into a parameter, and
a write of one row of the batch under accumulation are refused naming the line. On data 2
(the batch split over 2 ranks) the writes keep the split (set_item's SBP rule: no fallback
in the plan) and train like eager on 2 gloo ranks.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from graphc.errors import GraphcError
from graphc.meta import META_SBP
from helpers import (accumulate_grads, assert_same_as_eager, compile_graph, feed_split, global_input,
                     graphc_train, run_world)

STEPS, BATCH = 3, 8
P01 = graphc.placement("cpu", [0, 1])


def _columns(h):
    h = h.clone()
    h[:, 0] = 0.0
    h[:, 2] = h[:, 3] * 3
    h[..., 4:6] = h[..., 4:6].flip(-1)
    return h


def _mask(h):
    h = h.clone()
    h[h < -0.2] = 0.5
    return h


def _fresh(h):
    out = torch.zeros_like(h)
    out[:, :3] = h[:, :3] * 2
    return out + h


def _view_after(h):
    h = h.clone()
    h[:, 1] = 1.0
    head = h[:, :2]  # a view taken after the write sees it
    return h + head.sum(-1, keepdim=True)


def _augmented(h):
    h = h.clone()
    h[:, 0] += 1.0  # getitem, in-place add on the view, then the write back
    h[:, 1:3] *= 2.0
    return h


def _topk(h):
    top = torch.topk(h, 2, dim=-1)
    return h * top.values.sum(-1, keepdim=True) + top.indices.to(h.dtype).sum(-1, keepdim=True)


def _max_sort(h):
    m = h.max(dim=-1)
    s = torch.sort(h, dim=-1, descending=True)
    return h + m.values.unsqueeze(-1) + s.values[..., :1] * s.indices[..., :1].to(h.dtype)


HABITS = {"columns": _columns, "mask": _mask, "fresh": _fresh, "view_after": _view_after,
          "augmented": _augmented, "topk": _topk, "max_sort": _max_sort}


class Net(nn.Module):
    def __init__(self, habit):
        super().__init__()
        self.habit = habit
        self.inp = nn.Linear(5, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.habit(self.inp(x))))


class Train(graphc.Graph):
    def __init__(self, model, acc):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(acc)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, 5, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(STEPS)]


def _eager(habit, acc):
    torch.manual_seed(0)
    model = Net(habit)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        losses.append(accumulate_grads(model, F.cross_entropy, x, y, acc))
        opt.step()
    return losses, model.state_dict()


@pytest.mark.parametrize("acc", [1, 2])
@pytest.mark.parametrize("name", sorted(HABITS))
def test_item_writes_and_named_results_train_like_eager(name, acc):
    torch.manual_seed(0)
    losses, state = graphc_train(Train(Net(HABITS[name]), acc), _batches())
    want_losses, want_state = _eager(HABITS[name], acc)
    assert_same_as_eager(losses, {k.removeprefix("model."): v for k, v in state.items()}, want_losses,
                         want_state, f"{name}, accumulation {acc}")


def _through_view(h):
    h = h.clone()
    h[0][1] = 5.0  # writes h through the view h[0]: eager's h sees it
    return h


def _view_before(h):
    h = h.clone()
    head = h[:, :2]
    h[:, 1] = 1.0
    return h + head.sum(-1, keepdim=True)  # eager's head sees the write


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.register_buffer("scale", torch.ones(6))

    def forward(self, x):
        self.scale[0] = 2.0
        return self.inp(x) * self.scale


@pytest.mark.parametrize("habit, found", [
    (_through_view, "shares memory with the written tensor"),
    (_view_before, "shares memory with the written tensor"),
])
def test_a_write_another_view_would_see_is_refused(habit, found):
    with pytest.raises(GraphcError, match=found) as e:
        Train(Net(habit), 1)(*_batches()[0])
    assert "test_traced_writes.py" in str(e.value)


def test_a_write_into_a_buffer_is_refused():
    class G(Train):
        def build(self, x, y):
            loss = self.model(x).sum()
            loss.backward()
            return loss
    with pytest.raises(GraphcError, match="writes into the parameter or buffer 'model.scale'"):
        G(Scaled(), 1)(*_batches()[0])


def test_a_write_of_one_row_under_accumulation_is_refused():
    def one_row(h):
        h = h.clone()
        h[1] = h[1] * 2  # row 1 of the whole batch; per micro-batch, row 1 of each
        return h
    torch.manual_seed(0)
    losses, _ = graphc_train(Train(Net(one_row), 1), _batches()[:1])  # whole batch: fine
    assert losses == pytest.approx(_eager(one_row, 1)[0][:1], rel=1e-12)
    with pytest.raises(GraphcError, match="couples rows of the batch"):
        Train(Net(one_row), 2)(*_batches()[0])


SPLIT = ["columns", "mask", "fresh", "view_after"]


@pytest.mark.parametrize("name", SPLIT)
def test_item_writes_keep_a_split_batch(name):
    model = graphc.to_global(Net(HABITS[name]), placement=P01, sbp=sbp.broadcast)
    cg = compile_graph(Train(model, 1), [global_input(t, P01, sbp.split(0)) for t in _batches()[0]], 2)
    writes = [n for n in cg.gm.graph.nodes if getattr(n.target, "__name__", "") == "set_item"]
    assert writes and all(n.meta[META_SBP].out == (sbp.split(0),) for n in writes)
    assert not [n.name for n in cg.gm.graph.nodes if META_SBP in n.meta and n.meta[META_SBP].fallback]


def _data_parallel(rank, world):
    out = {}
    for name in SPLIT:
        torch.manual_seed(0)
        model = graphc.to_global(Net(HABITS[name]), placement=P01, sbp=sbp.broadcast)
        losses, state = graphc_train(Train(model, 1), _batches(), feed=feed_split(P01, rank))
        out[name] = (losses, state)
    return out


@pytest.mark.world
def test_item_writes_on_data_parallel_match_eager():
    for rank, got in enumerate(run_world(_data_parallel, 2)):
        for name in SPLIT:
            losses, state = got[name]
            want_losses, want_state = _eager(HABITS[name], 1)
            assert_same_as_eager(losses, {k.removeprefix("model."): v for k, v in state.items()},
                                 want_losses, want_state, f"{name}, data 2, rank {rank}")
