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


def _phi3():
    # Phi-3-mini's attention: as many key/value heads as query heads, one fused qkv_proj
    # sliced by position, one gate_up_proj chunked
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, pad_token_id=0, eos_token_id=0, bos_token_id=0))


MAKE = {"qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "phi3": _phi3}
# Megatron's pairs: the Linears declared column-parallel (weight split(0)), then row-parallel (split(1))
MEGATRON = {"phi3": ({"qkv_proj", "gate_up_proj"}, {"o_proj", "down_proj"})}


def megatron(model, kind):
    """Declares each Linear of MEGATRON[kind] split, on ranks 0-1."""
    column, row = MEGATRON[kind]
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in column or leaf in row:
            graphc.to_global(mod.weight, placement=P01, sbp=graphc.sbp.split(0 if leaf in column else 1))
            if leaf in column and mod.bias is not None:
                graphc.to_global(mod.bias, placement=P01, sbp=graphc.sbp.split(0))


class HubGraph(graphc.Graph):
    """A hub model trained on its own loss: `model(input_ids=ids, labels=labels).loss`."""

    def __init__(self, model, layout: str, kind: str, accumulation: int = 2):
        super().__init__()
        self.model = model
        if layout in ("dp2", "tp2"):
            self.model.config.set_stage(0, P01)
        if layout == "tp2":
            megatron(model, kind)
        elif layout not in ("one", "dp2"):
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


def collectives(graph):
    """The collectives of rank 0's plan for its first micro-batch."""
    from graphc.plan.instructions import Collective
    return [i for i in graph.compiled.plans[0].instructions if isinstance(i, Collective) and i.microbatch == 0]


def _check(kind, layout):
    data = _batches()
    graphs = []
    losses, state = train(layout, lambda layout: HubGraph(_model(kind), layout, kind), data, graphs=graphs)
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


def test_phi3_fused_qkv_sliced_by_position_splits_by_heads_on_tensor_2():
    """qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:] of a column-parallel qkv_proj
    (See NOTE: fused pieces): each rank computes its heads of q, k and v, with Megatron's
    collectives, one all-reduce per attention and per MLP forward and one each backward: 8
    for 2 layers per micro-batch (with 4 layers 16, where the plan had 32 before: q, k and v
    each gathered or reduced)."""
    graphs = _check("phi3", "tp2")
    assert fallbacks(graphs[0]) == []
    assert len(collectives(graphs[0])) == 8, [str(c) for c in collectives(graphs[0])]
