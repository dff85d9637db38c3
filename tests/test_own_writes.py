"""A value build() writes on its first trace (See NOTE: Writes of the first call,
graphc/guards/own_writes.py): Hugging Face's classification heads set `config.problem_type` from
the labels on their first call, which made every such model compile a second plan at its
second call. Where build() traced with the value it left makes the same graph, the plan
serves it (no recompile); where it makes another graph, a warning says so and the next call
compiles its plan. Both equal eager on the whole batch (float64, 1e-10), in one process."""
import pytest
import torch
import torch.nn as nn

from layouts import Pair, SquaredError, assert_same, batches, eager, train


class Settings:
    """A library's config object (not a module): build() may set its fields."""

    def __init__(self):
        self.kind = None
        self.scale = None


class LabelledPair(Pair):
    """Sets `settings.kind` on its first call, as HF sets problem_type: the graph is the same."""

    def __init__(self):
        super().__init__()
        self.settings = Settings()

    def forward(self, x):
        if self.settings.kind is None:
            self.settings.kind = "regression"
        return super().forward(x) if self.settings.kind == "regression" else x


class ScaledPair(Pair):
    """Sets `settings.scale` on its first call and scales the output from the second: another graph."""

    def __init__(self):
        super().__init__()
        self.settings = Settings()

    def forward(self, x):
        if self.settings.scale is None:
            self.settings.scale = 2.0
            return super().forward(x)
        return super().forward(x) * self.settings.scale


def _train(make_model, accumulation=1):
    """Accumulation > 1: compile traces the whole batch before the micro-batch, and the
    micro-batch's trace already sees the value the first one wrote."""
    graphs = []

    def make(layout):
        torch.manual_seed(0)
        return SquaredError(make_model(), layout, accumulation=accumulation)
    got = train("one", make, batches(), graphs=graphs)
    torch.manual_seed(0)
    return got, eager(make_model(), batches()), graphs[0]


def test_a_setting_written_on_the_first_call_that_keeps_the_graph_compiles_once():
    got, want, graph = _train(LabelledPair)
    assert_same(got, want, "one")
    assert graph.recompiles == []


def test_a_setting_written_on_the_first_call_that_changes_the_graph_is_said_and_recompiles():
    with pytest.warns(UserWarning, match=r"model.settings.scale from None to 2.0 while it was traced"):
        got, want, graph = _train(ScaledPair)
    assert_same(got, want, "one")
    assert len(graph.recompiles) == 1 and "model.settings" in graph.recompiles[0]


def test_under_accumulation_a_write_that_keeps_the_graph_trains_as_eager():
    got, want, graph = _train(LabelledPair, accumulation=2)
    assert_same(got, want, "one")
    assert graph.recompiles == []


def test_under_accumulation_a_write_that_changes_the_plans_graph_is_refused():
    """The whole batch's trace writes scale = 2.0, the micro-batch's trace then scales: the
    plan would scale at the first call, where eager does not (it was 1.789 against 1.583)."""
    from graphc.errors import GraphcError
    with pytest.raises(GraphcError, match=r"changed model.settings.scale from None to 2.0 while it was "
                                          r"traced for the whole batch.*Fix: set the value before the first call"):
        _train(ScaledPair, accumulation=2)


def test_hugging_face_classification_compiles_once():
    """DistilBERT's sequence classification with labels: problem_type set on the first call."""
    transformers = pytest.importorskip("transformers")
    cfg = dict(vocab_size=64, dim=16, hidden_dim=32, n_layers=1, n_heads=2, max_position_embeddings=16,
               num_labels=3, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0)

    def model():
        torch.manual_seed(0)
        return transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(**cfg))
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 64, (4, 6), generator=g), torch.randint(0, 3, (4,), generator=g)
    mask = torch.ones_like(ids)

    class Classify(SquaredError):
        def build(self, ids, mask, labels):
            out = self.model(input_ids=ids, attention_mask=mask, labels=labels)
            out.loss.backward()
            return out.loss
    graphs = []
    losses, state = train("one", lambda layout: Classify(model(), "one", accumulation=1), [(ids, mask, labels)] * 3,
                          graphs=graphs)
    reference = model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    want_losses = []
    for _ in range(3):
        loss = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(), loss.backward(), opt.step()
        want_losses.append(loss.item())
    want = (want_losses, {k: v.detach().clone() for k, v in reference.state_dict().items()})
    assert_same((losses, state), want, "one")
    assert graphs[0].recompiles == []
