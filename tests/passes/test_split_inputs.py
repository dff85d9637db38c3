"""split_inputs (NOTE: Batch split): under accumulation an input is split iff its dim 0 is the
batch size and it is not marked whole; find_batch_dims only confirms or refuses that choice.
And NOTE: Batch sums: a batch sum returned from build() is summed over micro-batches.
Each case against eager PyTorch on the whole batch in float64 (1e-10), one process."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc.passes.split_inputs import split_inputs
from helpers import assert_close

B, T, D, V = 8, 5, 6, 7


class MaskedTokens(nn.Module):
    """transformers' masking_utils habit: the mask read by advanced indexing with row indices
    built from a shape (it was judged 'not batched' and passed whole: loss 1.0099 vs 1.4978)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.out = nn.Linear(D, V)

    def forward(self, x, mask):
        b, t = x.shape[:2]
        keep = mask.bool()[torch.arange(b)[:, None], torch.arange(t)[None, :]]
        h = self.emb(x) * keep[..., None]
        return self.out(h)


class MaskGraph(graphc.Graph):
    def __init__(self, model, opt, m):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(m)
        self.add_optimizer(opt)

    def build(self, x, mask, y):
        logits = self.model(x, mask)
        loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
        loss.backward()
        return loss


def _mask_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([5, 3, 4, 1, 5, 2, 3, 5])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return x, mask, y


@pytest.mark.parametrize("m", [2, 4])
def test_mask_read_by_advanced_indexing_is_split_with_the_batch(m):
    torch.manual_seed(0)
    model = MaskedTokens()
    ref = copy.deepcopy(model)
    graph = MaskGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), m)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, mask, y = _mask_data()
    for _ in range(2):
        loss = graph(x, mask, y).to_local()
        want = F.cross_entropy(ref(x, mask).reshape(-1, V), y.reshape(-1))
        opt.zero_grad(), want.backward(), opt.step()
        assert_close(loss, want.detach(), "loss")
    for k, v in ref.state_dict().items():
        assert_close(model.state_dict()[k], v, k)


class TableGraph(graphc.Graph):
    """w is an [8, 8] matrix, not per-example data: its dim 0 only equals the batch size."""

    def __init__(self, model, opt, whole=()):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(2)
        if whole:
            self.config.set_whole_inputs(*whole)
        self.add_optimizer(opt)

    def build(self, x, y, w):
        h = self.model(x) * w.sum(0)
        loss = F.mse_loss(h, y)
        loss.backward()
        return loss


def _table_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, 8, generator=g), torch.randn(B, 8, generator=g), torch.randn(8, 8, generator=g)


def test_whole_batch_length_table_is_refused_naming_input_and_op():
    """It was split silently (loss 0.114 vs eager 0.064)."""
    model = nn.Linear(8, 8)
    graph = TableGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(graphc.GraphcError) as info:
        graph(*_table_data())
    msg = str(info.value)
    for part in ("couples rows of the batch", "w.sum(0)", "['x', 'y', 'w']", "set_whole_inputs"):
        assert part in msg, (part, msg)


def test_table_marked_whole_trains_like_eager():
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    ref = copy.deepcopy(model)
    graph = TableGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), whole=("w",))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y, w = _table_data()
    for _ in range(2):
        loss = graph(x, y, w).to_local()
        want = F.mse_loss(ref(x) * w.sum(0), y)
        opt.zero_grad(), want.backward(), opt.step()
        assert_close(loss, want.detach(), "loss")
    for k, v in ref.state_dict().items():
        assert_close(model.state_dict()[k], v, k)


class LinedUpGraph(TableGraph):
    def build(self, x, y, w):
        loss = F.mse_loss(self.model(x) + w, y)  # w's rows line up with x's: it is batch data
        loss.backward()
        return loss


def test_input_marked_whole_but_lined_up_with_the_batch_is_refused():
    model = nn.Linear(8, 8)
    graph = LinedUpGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), whole=("w",))
    with pytest.raises(graphc.GraphcError, match=r"input 'w' is passed whole .* remove 'w' from"):
        graph(*_table_data())


def test_unknown_whole_input_name_is_refused():
    with pytest.raises(graphc.GraphcError, match=r"set_whole_inputs names \['z'\].*\['x', 'y'\]"):
        split_inputs(["x", "y"], [torch.zeros(4, 2), torch.zeros(4)], ["z"])


def test_rule_splits_inputs_of_the_batch_length_only():
    got = split_inputs(["x", "y", "table", "scale"], [torch.zeros(4, 2), torch.zeros(4), torch.zeros(3, 2),
                                                      torch.zeros(())], [])
    assert got == [True, True, False, False]
    assert split_inputs(["x", "y"], [torch.zeros(4, 2), torch.zeros(4)], ["x"]) == [False, True]


class MetricGraph(graphc.Graph):
    def __init__(self, model, opt, m):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(m)
        self.add_optimizer(opt)

    def build(self, x, y):
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        hit = (logits.argmax(-1) == y)
        return loss, hit.sum(), hit.double().sum() / y.shape[0], (logits * 0 + 1).sum()


@pytest.mark.parametrize("m", [2, 4])
def test_batch_sums_are_summed_and_means_averaged(m):
    """n_correct = hit.sum() came back divided by the number of micro-batches."""
    torch.manual_seed(0)
    model = nn.Linear(D, 3)
    ref = copy.deepcopy(model)
    graph = MetricGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), m)
    x, y = torch.randn(B, D), torch.randint(0, 3, (B,))
    loss, n_correct, accuracy, total = graph(x, y)
    logits = ref(x)
    hit = logits.argmax(-1) == y
    assert n_correct.to_local().item() == hit.sum().item()
    assert_close(accuracy.to_local(), hit.double().mean(), "accuracy (a mean)")
    assert total.to_local().item() == B * 3
    assert_close(loss.to_local(), F.cross_entropy(logits, y).detach(), "loss")
