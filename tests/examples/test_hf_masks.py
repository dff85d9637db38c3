"""Hugging Face models with `attention_mask` (padded rows) under gradient accumulation, as
their authors wrote them (labels= computes the model's own loss), against eager PyTorch on
the whole batch in float64, on real gloo ranks: Llama and BERT on pipeline 2 at
accumulation 2 and 4, and on data 2 (issue 19, root cause 2).

Tolerance: parameters at the oracle's 1e-10. Llama's own loss upcasts the logits to float32
(`logits.float()` in transformers' ForCausalLMLoss), so its returned loss is a float32
number: graphc averages the micro-batches' float32 losses where eager takes one float32
mean, which differs by float32 rounding. Eager's own noise floor for that (the same loss
accumulated over 4 micro-batches in eager, against one whole-batch loss) is measured in
test_llama_loss_noise_floor_of_eager; the Llama loss is checked at 8x float32's eps
relative (about 4e-6 at a loss of 4), which that test shows eager itself needs. Everything
else, every parameter included, is at the oracle's 1e-10: Llama's parameters on data 2
were 8.2e-10 off until a partial sum stopped crossing RMSNorm's narrowing
`.to(torch.float32)` (sbp/rules.py: cast), and are now within 1.4e-17.
"""

import pytest
import torch

import graphc
from helpers import assert_close, run_world

transformers = pytest.importorskip("transformers")

B, T, V = 8, 12, 64
LLAMA_LOSS_RTOL = 8 * torch.finfo(torch.float32).eps


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _bert():
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=32, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


def _batch(kind):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([12, 5, 9, 12, 3, 7, 12, 10])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    if kind == "llama":
        return ids, mask, ids.masked_fill(mask == 0, -100)
    return ids, mask, torch.randint(0, 3, (B,), generator=g)


class HFGraph(graphc.Graph):
    def __init__(self, model, opt, accumulation, stages=None):
        super().__init__()
        self.model = model
        if stages:
            for path, sid in stages:
                block = self.model
                for part in path.split("."):
                    block = block[int(part)] if part.isdigit() else getattr(block, part)
                block.config.set_stage(sid, graphc.placement("cpu", [sid]))
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(opt)

    def build(self, ids, mask, labels):
        out = self.model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        return out.loss


STAGES = {
    "llama": [("model.embed_tokens", 0), ("model.layers.0", 0), ("model.layers.1", 1),
              ("model.norm", 1), ("lm_head", 1)],
    "bert": [("bert.embeddings", 0), ("bert.encoder.layer.0", 0), ("bert.encoder.layer.1", 1),
             ("bert.pooler", 1), ("classifier", 1)],
}
MAKE = {"llama": _llama, "bert": _bert}


def eager_steps(model, ids, mask, labels, steps=2):
    """The oracle for a Hugging Face model's own loss: eager SGD steps on the whole batch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(), loss.backward(), opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _eager(kind, steps=2):
    return eager_steps(MAKE[kind](), *_batch(kind), steps)


def _worker(rank, world, kind, layout, accumulation, steps=2):
    model = MAKE[kind]()
    stages = STAGES[kind] if layout == "pipeline" else None
    graph = HFGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation, stages)
    ids, mask, labels = _batch(kind)
    if layout == "data":
        where = graphc.placement("cpu", [0, 1])
        ids, mask, labels = (graphc.to_global(t.chunk(2)[rank], placement=where, sbp=graphc.sbp.split(0))
                             for t in (ids, mask, labels))
    losses = []
    for _ in range(steps):
        loss = graph(ids, mask, labels).to_local()
        losses.append(loss.item() if loss.numel() else None)
    return losses, {k: v.clone() for k, v in graph.full_state_dict().items()}


def _check(kind, results):
    want_losses, want_state = _eager(kind)
    assert any(r[0][0] is not None for r in results)
    for losses, state in results:
        if losses[0] is not None:
            got, want = torch.tensor(losses), torch.tensor(want_losses)
            if kind == "llama":  # a float32 loss (see the module docstring)
                torch.testing.assert_close(got, want, rtol=LLAMA_LOSS_RTOL, atol=0)
            else:
                assert_close(got, want, f"{kind}: losses")
        for k, v in want_state.items():
            assert_close(state[k], v, f"{kind}: {k}")


@pytest.mark.world
@pytest.mark.parametrize("kind", ["llama", pytest.param("bert", marks=pytest.mark.slow)])   # CI time: the sweep runs masked llama too
@pytest.mark.parametrize("accumulation", [pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])  # CI time: the sweep runs masked Llama on pp2 in the local world
def test_masked_hf_model_on_pipeline_2(kind, accumulation):
    _check(kind, run_world(_worker, 2, kind, "pipeline", accumulation))


@pytest.mark.world
@pytest.mark.parametrize("kind", ["llama", pytest.param("bert", marks=pytest.mark.slow)])   # CI time
def test_masked_hf_model_on_data_2(kind):
    _check(kind, run_world(_worker, 2, kind, "data", 2))


def test_llama_loss_noise_floor_of_eager():
    """Eager's own float32 loss, whole batch vs 4 micro-batches averaged: the tolerance of
    the Llama loss above is what eager needs against itself."""
    model = _llama()
    ids, mask, labels = _batch("llama")
    whole = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert whole.dtype == torch.float32  # the model's own upcast
    # per micro-batch, the loss weighted by its share of counted tokens, as graphc does
    count = (labels[:, 1:] != -100).sum()
    parts = []
    for i, m, lab in zip(ids.chunk(4), mask.chunk(4), labels.chunk(4)):
        n = (lab[:, 1:] != -100).sum()
        parts.append(model(input_ids=i, attention_mask=m, labels=lab).loss * n / count)
    accumulated = torch.stack(parts).sum()
    gap = (accumulated - whole).abs().item() / whole.item()
    assert 0 < gap <= LLAMA_LOSS_RTOL, gap

