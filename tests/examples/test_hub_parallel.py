"""Parallel means parallel on held-out hub models (issue 32): Hugging Face models as they come
(tiny configs, their own loss from `labels=`), on data 2 (the batch split) and tensor 2
(Megatron's column/row pairs declared split), in the one-process local world against
eager PyTorch on the whole batch in float64.

Equal numbers are not enough: a stage of several ranks may also lose its parallelism to
an op without an SBP rule, which gathers the batch (or the heads) and runs whole on every
rank. Each layout's plan is read too: no gathering fallback (tests/layouts.fallbacks).

Tolerance: parameters at the oracle's 1e-10; a causal LM's own loss upcasts its logits to
float32 (`logits.float()`), so its loss is compared at 8 float32 eps relative (the floor
tests/examples/test_hf_masks.py measures for eager itself).
"""
from __future__ import annotations

import pytest
import torch

import graphc
from helpers import assert_close
from layouts import fallbacks, train

transformers = pytest.importorskip("transformers")

B, T, V = 4, 6, 64
P01 = graphc.placement("cpu", [0, 1])
LOSS_RTOL = 8 * torch.finfo(torch.float32).eps


def _qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, experts_implementation="batched_mm"))


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        experts_implementation="batched_mm"))


MAKE = {"qwen3_moe": _qwen3_moe, "mixtral": _mixtral}


class HubGraph(graphc.Graph):
    """A hub model trained on its own loss: `model(input_ids=ids, labels=labels).loss`."""

    def __init__(self, model, layout: str, accumulation: int = 2):
        super().__init__()
        self.model = model
        if layout == "dp2":
            self.model.config.set_stage(0, P01)
        elif layout != "one":
            raise ValueError(layout)
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, ids, labels):
        out = self.model(input_ids=ids, labels=labels)
        out.loss.backward()
        return out.loss


def _model(kind):
    torch.manual_seed(0)
    return MAKE[kind]()


def _batches(steps=2):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g))
            for _ in range(steps)]


def _eager(kind, data):
    model = _model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for ids, labels in data:
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(), loss.backward(), opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check(kind, layout):
    data = _batches()
    graphs = []
    losses, state = train(layout, lambda layout: HubGraph(_model(kind), layout), data, graphs=graphs)
    want_losses, want_state = _eager(kind, data)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=LOSS_RTOL, atol=0)
    for k, v in want_state.items():
        assert_close(state[k], v, f"{kind} {layout}: {k}")
    return graphs


@pytest.mark.parametrize("kind", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])  # CI time: one router
def test_moe_router_keeps_the_batch_split_on_data_2(kind):
    """topk over the experts, repeat_interleave of the tokens, the experts' weights indexed by
    expert ids (See NOTE: Routing keeps the batch split): each rank routes its own rows."""
    graphs = _check(kind, "dp2")
    assert fallbacks(graphs[0]) == []
