"""Parallel means parallel on held-out hub models (issue 32): Hugging Face models as they come
(tiny configs, their own loss from `labels=`), on data 2 (the batch split) and tensor 2
(Megatron's column/row pairs declared split), in the one-process local world against
eager PyTorch on the whole batch in float64.

Equal numbers are not enough: a stage of several ranks may also lose its parallelism to
an op without an SBP rule, which gathers the batch (or the heads) and runs whole on every
rank. Each layout's plan is read too: no gathering fallback (tests/layouts.fallbacks) and
no replicated compute (tests/layouts.replicated, See NOTE: Replicated compute).

Tolerance: parameters and float64 losses at the oracle's 1e-10; a causal LM's own loss
upcasts its logits to float32 (`logits.float()`), so its loss is compared at 8 float32 eps
relative (the floor tests/examples/test_hf_masks.py measures for eager itself).

torchvision's models (EfficientNet, ConvNeXt, Swin) are not here: torchvision does not
install beside this CPU torch; tests/test_fx_wrap.py covers their fx.wrap'd functions.
"""
from __future__ import annotations

import pytest
import torch

import graphc
from helpers import assert_close, compile_graph, global_input
from layouts import fallbacks, replicated, train

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


def _phi3_gqa():
    # grouped-query attention: 4 query heads, 2 key/value heads; qkv_proj's slices q, k, v
    # are 32, 16 and 16 wide
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, eos_token_id=0, bos_token_id=0))


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))


def _t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=V, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0))


def _roberta():
    return transformers.RobertaForSequenceClassification(transformers.RobertaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=40, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=1))


def _distilbert():
    return transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(
        vocab_size=V, dim=32, hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=40, num_labels=3,
        dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0))


MAKE = {"qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "phi3": _phi3, "phi3_gqa": _phi3_gqa, "qwen2": _qwen2, "t5": _t5,
        "roberta": _roberta, "distilbert": _distilbert}
CLASSIFIERS = ("roberta", "distilbert")   # labels: one class of 3 per row
FLOAT32_LOSS = ("qwen3_moe", "mixtral", "phi3", "phi3_gqa", "qwen2")   # causal LMs: logits.float() in their loss
_LLAMA_PAIRS = ({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}, {"o_proj", "down_proj"})
# Megatron's pairs: the Linears declared column-parallel (weight split(0)), then row-parallel
# (split(1)); the MoE models' experts stay whole (their attention is split)
_PHI3_PAIRS = ({"qkv_proj", "gate_up_proj"}, {"o_proj", "down_proj"})
MEGATRON = {"phi3": _PHI3_PAIRS, "phi3_gqa": _PHI3_PAIRS, "qwen2": _LLAMA_PAIRS,
            "qwen3_moe": ({"q_proj", "k_proj", "v_proj"}, {"o_proj"}),
            "mixtral": ({"q_proj", "k_proj", "v_proj"}, {"o_proj"}),
            "t5": ({"q", "k", "v", "wi"}, {"o", "wo"}),
            "roberta": ({"query", "key", "value", "intermediate.dense"}, {"output.dense"}),
            "distilbert": ({"q_lin", "k_lin", "v_lin", "lin1"}, {"out_lin", "lin2"})}


def megatron(model, kind):
    """Declares each Linear of MEGATRON[kind] split, on ranks 0-1."""
    column, row = MEGATRON[kind]
    for name, mod in model.named_modules():
        leaf = ".".join(name.split(".")[-2:]) if name.endswith(".dense") else name.rsplit(".", 1)[-1]
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


def _batches(kind, steps=2):
    g = torch.Generator().manual_seed(0)
    labels = (lambda: torch.randint(0, 3, (B,), generator=g)) if kind in CLASSIFIERS else \
        (lambda: torch.randint(0, V, (B, T), generator=g))
    return [(torch.randint(2, V, (B, T), generator=g), labels()) for _ in range(steps)]


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
    """The collectives of rank 0's plan for its first micro-batch (a Graph called, or a CompiledGraph)."""
    from graphc.plan.instructions import Collective
    compiled = graph.compiled if isinstance(graph, graphc.Graph) else graph
    return [i for i in compiled.plans[0].instructions if isinstance(i, Collective) and i.microbatch == 0]


def _check(kind, layout):
    data = _batches(kind)
    graphs = []
    losses, state = train(layout, lambda layout: HubGraph(_model(kind), layout, kind), data, graphs=graphs)
    want_losses, want_state = _eager(kind, data)
    if kind in FLOAT32_LOSS:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=LOSS_RTOL, atol=0)
    else:
        assert_close(torch.tensor(losses), torch.tensor(want_losses), f"{kind} {layout}: losses")
    for k, v in want_state.items():
        assert_close(state[k], v, f"{kind} {layout}: {k}")
    return graphs


# (kind, layout) of the plan checks and the trained ones. By default (CI time) the cases a
# rule of issue 32 made parallel: Qwen3-MoE on data 2 and Phi-3 with grouped-query attention
# on tensor 2 trained (their plans checked there; its unequal q/k/v pieces cover the equal ones
# of Phi-3-mini, kept with -m slow), T5 on tensor 2 and RoBERTa on data 2 (cumsum's position
# ids) planned; everything else with -m slow.
CASES = [("t5", "dp2"), ("t5", "tp2"), ("qwen2", "dp2"), ("qwen2", "tp2"), ("qwen3_moe", "dp2"),
         ("qwen3_moe", "tp2"), ("mixtral", "dp2"), ("mixtral", "tp2"), ("phi3", "dp2"), ("phi3", "tp2"),
         ("phi3_gqa", "tp2"),
         ("roberta", "dp2"), ("roberta", "tp2"), ("distilbert", "dp2"), ("distilbert", "tp2")]
TRAINED_BY_DEFAULT = {("qwen3_moe", "dp2"), ("phi3_gqa", "tp2")}
PLANNED_BY_DEFAULT = {("t5", "tp2"), ("roberta", "dp2")}


def _cases(default):
    return [case if case in default else pytest.param(*case, marks=pytest.mark.slow) for case in CASES]


PLANS, TRAINED = _cases(PLANNED_BY_DEFAULT), _cases(TRAINED_BY_DEFAULT)


@pytest.mark.parametrize("kind,layout", PLANS)
def test_no_op_gathers_or_runs_replicated(kind, layout):
    """Compiled in one process for 2 ranks: no gathering fallback and no replicated compute
    (See NOTE: Replicated compute) on the stage of data 2 (the batch split) or tensor 2
    (Megatron's pairs declared)."""
    ids, labels = _batches(kind)[0]
    inputs = [global_input(t, P01, graphc.sbp.split(0)) for t in (ids, labels)] if layout == "dp2" else [ids, labels]
    compiled = compile_graph(HubGraph(_model(kind), layout, kind), inputs, 2)
    assert fallbacks(compiled) == []
    assert replicated(compiled) == {0: 0.0}
    if (kind, layout) == ("t5", "tp2"):
        # Megatron's 5 all-reduces forward (2 encoder, 3 decoder) and 6 backward; the relative
        # bias tables, whole, summed once a step (See NOTE: Whole values with a summed
        # gradient), where each attention stack's bias all-gathered its gradient every micro-batch
        comms = collectives(compiled)
        assert len(comms) == 11 and {c.kind for c in comms} == {"all_reduce"}, [str(c) for c in comms]


@pytest.mark.parametrize("kind,layout", TRAINED)
def test_trains_as_eager_without_gathering(kind, layout):
    """Two steps at accumulation 2 in the local world equal eager on the whole batch. Data 2:
    Qwen3-MoE's router keeps the batch split (topk over the experts, repeat_interleave of
    the tokens, the experts' weights indexed by expert ids: See NOTE: Routing keeps the
    batch split). Tensor 2: Phi-3's qkv[..., :q_end], qkv[..., q_end:k_end], qkv[..., k_end:]
    of a column-parallel qkv_proj split by heads (See NOTE: fused pieces) with Megatron's
    collectives, one all-reduce per attention and per MLP forward and one each backward: 8
    for 2 layers per micro-batch (with 4 layers 16, where the plan had 32 before: q, k and v
    each gathered or reduced). With grouped-query attention (phi3_gqa) the pieces are unequal
    (q 32 wide, k and v 16): each rank holds 2 query heads and the key/value head they read,
    the same 8 (16 before: k and v reduced, their gradients gathered)."""
    graphs = _check(kind, layout)
    assert fallbacks(graphs[0]) == [] and replicated(graphs[0]) == {0: 0.0}
    if kind in ("phi3", "phi3_gqa") and layout == "tp2":
        assert len(collectives(graphs[0])) == 8, [str(c) for c in collectives(graphs[0])]
