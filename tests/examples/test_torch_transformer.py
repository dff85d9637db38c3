"""The Transformer of PyTorch's own DTensor tests, as its authors wrote it, against eager.

`torch.testing._internal.distributed._tensor.common_dtensor.Transformer` with tied weights
(output.weight = tok_embeddings.weight), a seq-len assert, positions from arange and
`self.output(h).float()`: pipeline 2 (the tied weight on both stages) and tensor 2
(Megatron layout declared with to_global, the tied embedding vocabulary-parallel).
Dropout is 0 (eager's masks are not a pipeline's; see docs/design.md on randomness).

Tolerance: the model itself casts its logits to float32 (`.float()`), so the loss and the
gradients entering the model pass through fp32 rounding (relative 6e-8 per value): parameters
are compared at 1e-6 after 3 SGD steps, not at the float64 oracle's 1e-10.
"""
import pytest
import torch
import torch.nn.functional as F

import graphc
from helpers import run_world

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)


def _common():
    """torch's DTensor test module, imported when a test runs: its import (hypothesis, torch's
    test harness) took 3.4 s of every collection, the one-process loop's too (issue 36)."""
    return pytest.importorskip("torch.testing._internal.distributed._tensor.common_dtensor",
                               reason="needs the expecttest package (pip install graphc[test])")


STEPS, BATCH, SEQ, VOCAB = 3, 8, 12, 16
TOL = 1e-6


def make_model():
    torch.manual_seed(0)
    common = _common()
    args = common.ModelArgs(n_layers=2, vocab_size=VOCAB, max_seq_len=16, dim=16, n_heads=4,
                            dropout_p=0.0, weight_tying=True)
    return common.Transformer(args)


def batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(STEPS)]


def lm_loss(logits, y):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


class TransformerGraph(graphc.Graph):
    def __init__(self, model, opt, layout):
        super().__init__()
        self.model = model
        if layout == "pp2":
            p0, p1 = graphc.placement("cpu", ranks=[0]), graphc.placement("cpu", ranks=[1])
            for name in ("tok_embeddings", "pos_embeddings"):
                getattr(self.model, name).config.set_stage(0, p0)
            self.model.layers[0].config.set_stage(0, p0)
            self.model.layers[1].config.set_stage(1, p1)
            self.model.norm.config.set_stage(1, p1)
            self.model.output.config.set_stage(1, p1)
        if layout == "tp2":
            p = graphc.placement("cpu", ranks=[0, 1])
            for layer in model.layers:
                for lin, dim in ((layer.attention.wq, 0), (layer.attention.wk, 0), (layer.attention.wv, 0),
                                 (layer.attention.wo, 1), (layer.feed_forward.w1, 0),
                                 (layer.feed_forward.w2, 1)):
                    graphc.to_global(lin.weight, placement=p, sbp=graphc.sbp.split(dim))
                graphc.to_global(layer.feed_forward.w1.bias, placement=p, sbp=graphc.sbp.split(0))
            graphc.to_global(model.output.weight, placement=p, sbp=graphc.sbp.split(0))
        self.config.set_gradient_accumulation_steps(2)
        self.add_optimizer(opt)

    def build(self, tokens, targets):
        loss = lm_loss(self.model(tokens), targets)
        loss.backward()
        return loss


def _train(rank, world, layouts):
    out = {}
    for layout in layouts:
        model = make_model()
        graph = TransformerGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), layout)
        losses = []
        for x, y in batches():
            loss = graph(x, y).to_local()
            losses += [loss.item()] if loss.numel() else []
        out[layout] = {"losses": losses, "state": graph.full_state_dict(), "plan": str(graph.plan)}
    return out


def test_torch_test_transformer_pipeline_and_tensor_parallel_match_eager():
    _common()   # skipped here, before any rank starts, without the package
    results = run_world(_train, 2, ("pp2", "tp2"))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_losses = []
    for x, y in batches():
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    ref_state = model.state_dict()
    for layout in ("pp2", "tp2"):
        for rank, res in enumerate(results):
            got = res[layout]
            assert set(got["state"]) == set(ref_state)
            if got["losses"]:
                torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses),
                                           atol=TOL, rtol=TOL)
            for k, v in ref_state.items():
                torch.testing.assert_close(got["state"][k], v, atol=TOL, rtol=TOL,
                                           msg=lambda m, k=k: f"{layout} rank {rank} {k}\n{m}")
        assert "fallback" not in results[0][layout]["plan"], f"{layout}: an op fell back"
