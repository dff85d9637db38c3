"""Hugging Face T5 trained with `labels=` alone (its documented call) under gradient
accumulation: its `_shift_right` makes the decoder's input with `shifted[..., 1:] =
labels[..., :-1]`, which keeps every row in place, so the micro-batches may split it (it was
refused as "writes rows of the batch into other positions"). Equal to eager on the whole
batch (float64; HF's T5 loss is computed in the model's dtype)."""
import pytest
import torch

import graphc
from layouts import assert_same, fallbacks, replicated, train

transformers = pytest.importorskip("transformers")


def _make():
    cfg = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1,
                                num_heads=2, decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(cfg)


class T5Graph(graphc.Graph):
    def __init__(self, model, layout):
        super().__init__()
        self.model = model
        if layout == "dp2":
            self.model.config.set_stage(0, graphc.placement("cpu", [0, 1]))
        self.config.set_gradient_accumulation_steps(2)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, ids, labels):
        out = self.model(input_ids=ids, labels=labels)
        out.loss.backward()
        return out.loss


@pytest.mark.parametrize("layout", ["one", "dp2"])
def test_t5_with_labels_alone_under_accumulation(layout):
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(1, 64, (4, 6), generator=g), torch.randint(1, 64, (4, 5), generator=g))
               for _ in range(2)]
    model = _make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for ids, labels in batches:
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    want = (losses, {k: v.detach().clone() for k, v in model.state_dict().items()})
    graphs = []
    assert_same(train(layout, lambda layout: T5Graph(_make(), layout), batches, graphs=graphs), want, layout)
    assert fallbacks(graphs[0]) == []   # new_zeros of a split batch gathered it first
    assert all(share == 0.0 for share in replicated(graphs[0]).values())
