"""Reductions over the batch mean what they mean in eager on every layout (NOTE: Batch sums in
graphc/passes/find_batch_dims.py; issue 30 rows 1 and 8), in the layout matrix of
tests/layouts.py against eager on the whole batch:

- a loss divided by a count of the whole batch that the user passes in (a 0-d tensor input,
  or a Python number) is a batch sum: its micro-batches' parts add up, so each one's
  gradient counts whole (before, each was scaled by 1/m as a mean's, and the step trained
  at 1/m of eager's loss and gradient);
- a count returned from build() (`(logits.argmax(-1) == y).sum()`) is the whole batch's,
  in its own dtype (a Long count was averaged, or crashed the output merge on dp and pp x dp);
- transformers' `num_items_in_batch` (the Trainer's whole-batch count of label tokens, by
  which the HF loss divides its sum) on one process, pp2 and dp2 at accumulation 2 and 4.
"""
import pytest
import torch
import torch.nn.functional as F

import graphc
from graphc.compiler import compile as compile_graph
from graphc.runtime.local_world import LocalWorld
from helpers import assert_close
from layouts import NPROC, Computing, Pair, assert_same, declare, every_layout, feed, train

B, STEPS, LR = 8, 2, 0.1


def _regression(steps=STEPS):
    """(x, y, n): n the whole batch's number of target entries, a 0-d tensor."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        x, y = torch.randn(B, 6, generator=g), torch.randn(B, 4, generator=g)
        out.append((x, y, torch.tensor(float(y.numel()))))
    return out


def _summed_loss(model, x, y, n):
    return ((model(x) - y) ** 2).sum() / n


class CountedGraph(graphc.Graph):
    """The loss divided by the whole batch's count: a 0-d tensor input, or a Python number."""

    def __init__(self, layout, count=None, accumulation=2):
        super().__init__()
        torch.manual_seed(0)
        self.model, self.count = Pair(), count
        declare(self, layout)
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=LR))

    def build(self, x, y, n):
        loss = _summed_loss(self.model, x, y, n if self.count is None else self.count)
        loss.backward()
        return loss


def _eager(loss_fn, batches, model=None):
    """Eager SGD on the whole batch: (losses, state)."""
    torch.manual_seed(0)
    model = model or Pair()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in batches:
        loss = loss_fn(model, *batch)
        opt.zero_grad(), loss.backward(), opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@every_layout
@pytest.mark.parametrize("count", ["input", "number"])
def test_loss_over_a_count_passed_in_is_a_batch_sum(layout, count):
    """((out - y) ** 2).sum() / n, n the whole batch's element count: eager's loss and steps
    at accumulation 2 (before: half of both)."""
    batches = _regression()
    number = float(batches[0][1].numel()) if count == "number" else None
    got = train(layout, lambda layout: CountedGraph(layout, number), batches)
    assert_same(got, _eager(_summed_loss, batches), layout)


def test_the_plan_names_a_batch_sum_loss():
    """The last stage's program says its loss is a batch sum (seeded with 1, not 1/m); a
    mean over the micro-batch's own entries stays a mean."""
    x, y, n = _regression(1)[0]
    summed = compile_graph(CountedGraph("pp2"), [x, y, n], 2).programs[1]
    assert summed.loss_summed and summed.loss_weight(2) == 1.0 and "(batch sum)" in str(summed)
    mean = compile_graph(CountedGraph("pp2", count=float(y.numel()) / 2), [x, y, n], 2).programs[1]
    assert not mean.loss_summed and mean.loss_weight(2) == 0.5


# -- a count returned from build() ----------------------------------------------------------
def _classes(steps=STEPS, batch=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 6, generator=g), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]


class AccuracyGraph(graphc.Graph):
    def __init__(self, layout):
        super().__init__()
        torch.manual_seed(0)
        self.model = Pair()
        declare(self, layout)
        self.config.set_gradient_accumulation_steps(2)
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=LR))

    def build(self, x, y):
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        hit = logits.argmax(-1) == y
        return loss, hit.sum(), hit.double().sum(), hit.sum().int()


def _eager_counts(batches):
    torch.manual_seed(0)
    model = Pair()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for x, y in batches:
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad(), loss.backward(), opt.step()
        out.append((loss.detach(), (logits.argmax(-1) == y).sum()))
    return out


def _returned(layout, batches):
    """Per step, the outputs of the rank that holds them (the last stage's first rank)."""
    args = feed(layout, batches)

    def rank_main(rank):
        graph = AccuracyGraph(layout)
        steps = [graph(*(args(rank, i) if callable(args) else args[i])) for i in range(len(batches))]
        return [tuple(t.to_local() for t in out) for out in steps]

    results = LocalWorld(NPROC[layout]).run(rank_main)
    return next(r for r in results if r[0][1].numel())


@every_layout
def test_returned_count_is_the_whole_batch_count(layout):
    batches = _classes()
    for step, ((loss, *hits), (want_loss, want_hits)) in enumerate(
            zip(_returned(layout, batches), _eager_counts(batches))):
        assert [h.dtype for h in hits] == [torch.int64, torch.float64, torch.int32], layout
        assert [h.item() for h in hits] == [want_hits.item()] * 3, f"{layout}: step {step}: {hits}"
        assert_close(loss, want_loss, f"{layout}: loss at step {step}")



# -- transformers' num_items_in_batch ---------------------------------------------------------
LLAMA_STAGES = [("model.embed_tokens", 0), ("model.layers.0", 0), ("model.layers.1", 1), ("model.norm", 1),
                ("lm_head", 1)]
LLAMA_LOSS_RTOL = 8 * torch.finfo(torch.float32).eps  # HF's loss is float32 (test_hf_masks.py)


def _llama():
    transformers = pytest.importorskip("transformers")   # only these tests need it
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _tokens(steps=STEPS, T=12):
    """(ids, mask, labels, num_items_in_batch) per step: padded rows of different lengths, and
    the Trainer's count of the whole batch's label tokens (labels shifted by one), a 0-d Long."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (B, T), generator=g)
        mask = (torch.arange(T)[None] < torch.randint(2, T + 1, (B, 1), generator=g)).long()
        labels = ids.masked_fill(mask == 0, -100)
        out.append((ids, mask, labels, (labels[:, 1:] != -100).sum()))
    return out


class LlamaGraph(graphc.Graph):
    def __init__(self, layout, accumulation):
        super().__init__()
        self.model = _llama()
        if layout == "pp2":
            for path, stage in LLAMA_STAGES:
                block = self.model   # graphc's blocks, attribute by attribute
                for part in path.split("."):
                    block = block[int(part)] if part.isdigit() else getattr(block, part)
                block.config.set_stage(stage, graphc.placement("cpu", [stage]))
        elif layout == "dp2":
            self.model.config.set_stage(0, graphc.placement("cpu", [0, 1]))
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=LR))

    def build(self, ids, mask, labels, n):
        out = self.model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n)
        out.loss.backward()
        return out.loss


def _hf_loss(model, ids, mask, labels, n):
    return model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n).loss


@pytest.mark.parametrize("layout", ["one", "pp2", "dp2"])
@pytest.mark.parametrize("accumulation", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_hf_num_items_in_batch(layout, accumulation):
    """The Trainer's call: the loss is the sum over label tokens / num_items_in_batch, a batch
    sum; its steps equal eager's on the whole batch (before: 1/m of the loss and gradient)."""
    batches = _tokens()
    losses, state = train(layout, lambda layout: LlamaGraph(layout, accumulation), batches)
    want_losses, want_state = _eager(_hf_loss, batches, _llama())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=LLAMA_LOSS_RTOL, atol=0)
    for k, v in want_state.items():
        assert_close(state[k], v, f"{layout}: {k}")


def _mse(out, y):
    return ((out - y) ** 2).mean()


UNMERGED = {   # what build() computes -> the loss and what it returns first; why it is refused
    "sum plus mean returned": (lambda out, y: (out.sum() + _mse(out, y), _mse(out, y)), "adds a sum"),
    "perplexity returned": (lambda out, y: (torch.exp(_mse(out, y).detach()), _mse(out, y)), "'exp'"),
    "max over the batch returned": (lambda out, y: (out.max(), _mse(out, y)), "'max"),
    "sum plus mean as the loss": (lambda out, y: (_mse(out, y) + 0.01 * out.sum(),) * 2, "the loss at"),
}


@pytest.mark.parametrize("name", list(UNMERGED))
def test_a_value_no_merge_of_micro_batches_gives_is_refused(name):
    """Under accumulation, a returned value (or the loss) whose micro-batches' values merged are
    not eager's on the whole batch is refused at the user's line (NOTE: Batch sums); before, it
    was averaged: silently different even in one process."""
    compute, why = UNMERGED[name]
    x, y, _ = _regression(1)[0]
    with pytest.raises(graphc.GraphcError, match=why) as err:
        Computing("one", compute, accumulation=2)(x, y)
    assert "test_reductions.py" in str(err.value) and "Fix:" in str(err.value)


@pytest.mark.parametrize("layout", ["one", "dp2"])
@pytest.mark.parametrize("name", list(UNMERGED))
def test_without_accumulation_they_are_eager(layout, name):
    """Without micro-batches the same programs are exact: data parallelism reduces over the
    ranks by SBP (partial sums all-reduced before a nonlinear op), not by a merge."""
    compute = UNMERGED[name][0]
    batches = [(x, y) for x, y, _ in _regression()]

    def step(model, x, y):
        return compute(model(x), y)
    torch.manual_seed(0)
    model = Pair()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    want = []
    for x, y in batches:
        first, loss = step(model, x, y)
        want.append(first.item())
        opt.zero_grad(), loss.backward(), opt.step()
    got, state = train(layout, lambda lay: Computing(lay, compute, accumulation=1), batches)
    assert got == pytest.approx(want, abs=1e-10), (got, want)
    for k, v in model.state_dict().items():
        assert_close(state[k], v, f"{layout} {k}")
