"""Hugging Face models whose ops keep the batch's rows apart in ways graphc/rows must see
(issue 21): GPT-2 (Conv1D is `torch.addmm(bias, x.view(-1, nx), weight)`) and Mixtral
(top-2 routing over 4 experts, tokens dispatched within the flattened batch*seq rows), on
pipeline 2 at accumulation 2, on real gloo ranks, against eager PyTorch on the whole batch
in float64.

Tolerance: parameters at the oracle's 1e-10. The returned loss is a float32 number
(transformers' ForCausalLMLoss upcasts the logits with `logits.float()`), so it is checked
at test_hf_masks.LLAMA_LOSS_RTOL, the floor eager needs against itself for that same loss
(measured in test_hf_masks.test_llama_loss_noise_floor_of_eager).
"""
import pytest
import torch

from helpers import assert_close, run_world
from test_hf_masks import LLAMA_LOSS_RTOL, HFGraph

transformers = pytest.importorskip("transformers")

B, T, V = 8, 12, 64


def _gpt2():
    # activation_function="gelu": the default "gelu_new" (NewGELUActivation) calls
    # torch.pow(x, 3.0), which segfaults graphc's tracer today (see the module's NOTE below)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  activation_function="gelu", bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _mixtral():
    cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=32,
                                     experts_implementation="batched_mm")
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg)


MAKE = {"gpt2": _gpt2, "mixtral": _mixtral}
STAGES = {
    "gpt2": [("transformer.wte", 0), ("transformer.wpe", 0), ("transformer.h.0", 0), ("transformer.h.1", 1),
             ("transformer.ln_f", 1), ("lm_head", 1)],
    "mixtral": [("model.embed_tokens", 0), ("model.layers.0", 0), ("model.layers.1", 1), ("model.norm", 1),
                ("lm_head", 1)],
}


def _batch(masked: bool):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([12, 5, 9, 12, 3, 7, 12, 10]) if masked else torch.full((B,), T)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _eager(kind, masked, steps=2):
    model = MAKE[kind]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids, mask, labels = _batch(masked)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(), loss.backward(), opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _worker(rank, world, kind, masked, steps=2):
    model = MAKE[kind]()
    graph = HFGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, STAGES[kind])
    ids, mask, labels = _batch(masked)
    losses = []
    for _ in range(steps):
        loss = graph(ids, mask, labels).to_local()
        losses.append(loss.item() if loss.numel() else None)
    return losses, {k: v.clone() for k, v in graph.full_state_dict().items()}


def _check(kind, masked, results):
    want_losses, want_state = _eager(kind, masked)
    assert any(r[0][0] is not None for r in results)
    for losses, state in results:
        if losses[0] is not None:  # a float32 loss (see the module docstring)
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses),
                                       rtol=LLAMA_LOSS_RTOL, atol=0)
        for k, v in want_state.items():
            assert_close(state[k], v, f"{kind}: {k}")


@pytest.mark.world
@pytest.mark.parametrize("masked", [False, True])
def test_gpt2_addmm_on_pipeline_2_at_accumulation_2(masked):
    _check("gpt2", masked, run_world(_worker, 2, "gpt2", masked))


@pytest.mark.world
@pytest.mark.parametrize("masked", [False, True])
def test_mixtral_moe_on_pipeline_2_at_accumulation_2(masked):
    """transformers' batched_mm experts: each token repeated once per chosen expert
    (repeat_interleave), the chosen experts' weights looked up by the token's expert ids, a
    bmm per token, the top-2 outputs summed back into the token's row."""
    _check("mixtral", masked, run_world(_worker, 2, "mixtral", masked))
