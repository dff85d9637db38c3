"""Expert parallelism on Hugging Face MoE models as they come (issue 34; See NOTE: Expert
parallel, graphc/ops/experts.py): Mixtral and Qwen3-MoE (tiny configs, their own loss from
`labels=`, the router's auxiliary loss with `output_router_logits=True`) with their experts'
stacked weights declared split(0) over an axis, trained in the one-process local world
against eager PyTorch on the whole batch in float64.

Layouts (LAYOUTS): ep2 and ep4 (the batch and the experts split over the same ranks, as
DeepSpeed-MoE puts experts on the data ranks), dp2 x ep2 (4 ranks, the batch over both axes,
the experts over the second: their gradient reduced only over the first), pp2 x ep2 (two
stages of two ranks, each stage's experts split over its ranks), tp2 x ep2 (the experts and
the batch over the first axis, Megatron's attention heads over the second); for the aux loss
through the pipeline (tests/examples/test_hub_experts_pipeline.py) pp2 x dp2 x ep2 and four
stages on two pipeline ranks (interleaved_1f1b, zbv, dualpipev).

Tolerance: parameters at the oracle's 1e-10, at 2e-9 with the router's aux loss (AUX_ATOL:
transformers computes it in float32); a causal LM's own loss upcasts its logits to float32, so
its loss is compared at 8 float32 eps relative (as tests/examples/test_hub_parallel.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Tuple

import pytest
import torch

import graphc
from graphc.runtime.local_world import LocalWorld
from graphc.tools.routing import load_factor, read_routing, routed_plans, routing_table
from helpers import assert_close, compile_graph, global_input, run_world

transformers = pytest.importorskip("transformers")

B, T, V = 8, 6, 64
COEF = 0.001   # transformers' default router_aux_loss_coef
# transformers computes the router's aux loss in float32 (histc counts, `routing_weights.float()`
# sums). With it on a split batch, parameters depart from eager by up to 1.2e-9 after two steps
# (Qwen3-MoE dp2 x ep2; 3.8e-10 on plain data 4 without expert parallelism, 7.8e-10 for
# Mixtral on data 2), growing with the coefficient (0 at 0, 1e-15 at 1e-6); without the aux
# loss every layout holds 1e-10. So runs with it are compared at 2e-9.
AUX_ATOL = 2e-9
LOSS_RTOL = 8 * torch.finfo(torch.float32).eps
S0, BC = graphc.sbp.split(0), graphc.sbp.broadcast
P01 = graphc.placement("cpu", [0, 1])


def _mixtral(impl="batched_mm", experts=4, aux=True):
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=experts, num_experts_per_tok=2, max_position_embeddings=32,
        experts_implementation=impl, output_router_logits=aux, router_aux_loss_coef=COEF))


def _qwen3_moe(impl="batched_mm", experts=4, aux=True):
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=experts, num_experts_per_tok=2,
        max_position_embeddings=32, experts_implementation=impl, output_router_logits=aux,
        router_aux_loss_coef=COEF))


MAKE = {"mixtral": _mixtral, "qwen3_moe": _qwen3_moe}


def switch_loss_float64(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """transformers' load_balancing_loss_func (Switch Transformer's aux loss, without a mask)
    with its sums in float64 instead of float32: the mathematics at the oracle's 1e-10."""
    counts = probs = 0.0
    rows = 0
    for logits in gate_logits:
        weights = torch.softmax(logits, dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        counts = counts + torch.histc(chosen.reshape(-1).to(weights.dtype), bins=num_experts, min=0, max=num_experts)
        probs = probs + weights.sum(dim=0)
        rows += weights.shape[0]
    return torch.sum((counts / rows) * (probs / rows)) * num_experts


@contextmanager
def aux_in_float64():
    """Mixtral's and Qwen3-MoE's forward calling switch_loss_float64 instead of their float32 one."""
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.qwen3_moe import modeling_qwen3_moe
    modules = (modeling_mixtral, modeling_qwen3_moe)
    saved = [m.load_balancing_loss_func for m in modules]
    for m in modules:
        m.load_balancing_loss_func = switch_loss_float64
    try:
        yield
    finally:
        for m, fn in zip(modules, saved):
            m.load_balancing_loss_func = fn


def model_of(kind: str, skewed: bool = False, dtype=torch.float64, **config):
    torch.manual_seed(0)
    model = MAKE[kind](**config).to(dtype)
    if skewed:
        skew(model)
    return model


def skew(model) -> None:
    """A router that sends every token to experts 0 and 1: a large positive feature in every
    token's embedding (dim 0), which the routers weigh +, + for experts 0 and 1 and - for the
    others. On ep2 the rank holding experts 2 and 3 then receives no token (empty exchanges)."""
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 30.0
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate[:, 0] = torch.tensor([4.0, 2.0] + [-4.0] * (gate.shape[0] - 2))   # float32 softmax keeps all > 0 (no tie at 0)


# pipeline 2: the embedding and layer 0 on the first stage, layer 1, norm and head on the second
STAGE_OF = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1, "lm_head": 1}
# four stages (two chunks per pipeline rank): the embedding, each layer, the norm and head
FOUR_STAGES = {"model.embed_tokens": 0, "model.layers.0": 1, "model.layers.1": 2, "model.norm": 3, "lm_head": 3}


@dataclass(frozen=True)
class EPLayout:
    """Where a layout puts the model: its ranks, per stage the placement, the experts' sbp and
    the inputs', which module runs on which stage and the pipeline schedule ("": the default)."""

    nproc: int
    stages: Tuple[Tuple[object, ...], ...]     # per stage: its placement's ranks
    experts: tuple                             # the experts' sbp on a stage's placement
    inputs: tuple                              # the batch's sbp on the first (ids) and last (labels) stage
    stage_of: Tuple[Tuple[str, int], ...] = tuple(STAGE_OF.items())
    schedule: str = ""

    def placement(self, stage: int):
        return graphc.placement("cpu", list(self.stages[stage]))


LAYOUTS = {
    "ep2": EPLayout(2, ((0, 1),), (S0,), (S0,)),
    "ep4": EPLayout(4, ((0, 1, 2, 3),), (S0,), (S0,)),
    "dp2xep2": EPLayout(4, (((0, 1), (2, 3)),), (BC, S0), (S0, S0)),
    "pp2xep2": EPLayout(4, ((0, 1), (2, 3)), (S0,), (S0,)),
    # the first axis: experts and batch split (expert parallel); the second: Megatron's attention
    "tp2xep2": EPLayout(4, (((0, 1), (2, 3)),), (S0, BC), (S0, BC)),
    # two stages, each a data 2 x expert 2 grid
    "pp2xdp2xep2": EPLayout(8, (((0, 1), (2, 3)), ((4, 5), (6, 7))), (BC, S0), (S0, S0)),
    # four stages on two pipeline ranks: interleaved (stage s on stage s mod 2's ranks) and the
    # V of zbv (stages 0 and 3 on ranks 0, 1; 1 and 2, both layers, on ranks 2, 3)
    "pp2xep2_interleaved": EPLayout(4, ((0, 1), (2, 3), (0, 1), (2, 3)), (S0,), (S0,), tuple(FOUR_STAGES.items()),
                                    "interleaved_1f1b"),
    "pp2xep2_zbv": EPLayout(4, ((0, 1), (2, 3), (2, 3), (0, 1)), (S0,), (S0,), tuple(FOUR_STAGES.items()), "zbv"),
    "pp2xep2_dualpipev": EPLayout(4, ((0, 1), (2, 3), (2, 3), (0, 1)), (S0,), (S0,), tuple(FOUR_STAGES.items()),
                                  "dualpipev"),
}
TENSOR_AXIS = {"tp2xep2": 1}   # layouts whose attention is split Megatron's way on this axis


def _module(model, path: str):
    for part in path.split("."):
        model = model[int(part)] if part.isdigit() else getattr(model, part)
    return model


class MoEGraph(graphc.Graph):
    """A hub MoE model on its own loss, its experts split over the layout's expert axis."""

    def __init__(self, model, layout: str, accumulation: int = 1, optimizer=None, zero: int = 0):
        super().__init__()
        self.model = model
        spec = LAYOUTS[layout]
        stage_of = dict(spec.stage_of)
        if len(spec.stages) == 1:
            self.model.config.set_stage(0, spec.placement(0))
        else:
            for path, stage in stage_of.items():
                _module(self.model, path).config.set_stage(stage, spec.placement(stage))
        for i, layer in enumerate(model.model.layers):
            stage = stage_of[f"model.layers.{i}"] if len(spec.stages) > 1 else 0
            graphc.to_global(layer.mlp.experts, placement=spec.placement(stage), sbp=spec.experts)
        if spec.schedule:
            self.config.set_pipeline_schedule(spec.schedule)
        if layout in TENSOR_AXIS:
            megatron_attention(model, spec.placement(0))
        if zero:
            self.config.enable_zero(True, stage=zero)
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(optimizer or torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, ids, labels):
        out = self.model(input_ids=ids, labels=labels)
        out.loss.backward()
        return out.loss


def megatron_attention(model, placement) -> None:
    """q, k, v split by heads (weight split(0)) and o_proj by its input (split(1)) on the
    placement's second axis, whole on the first."""
    for layer in model.model.layers:
        attn = layer.self_attn
        for lin, dim in ((attn.q_proj, 0), (attn.k_proj, 0), (attn.v_proj, 0), (attn.o_proj, 1)):
            graphc.to_global(lin.weight, placement=placement, sbp=(BC, graphc.sbp.split(dim)))


def batches(steps: int = 2, rows: int = B):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(2, V, (rows, T), generator=g), torch.randint(0, V, (rows, T), generator=g))
            for _ in range(steps)]


def local_inputs(layout: str, rank: int, ids, labels):
    """This rank's shards of the batch: ids on the first stage's ranks, labels on the last's."""
    spec = LAYOUTS[layout]
    out = []
    for stage, t in ((0, ids), (len(spec.stages) - 1, labels)):
        pieces, k = _batch_piece(spec.stages[stage], spec.inputs, rank)
        sbp = spec.inputs if len(spec.inputs) > 1 else spec.inputs[0]
        out.append(graphc.to_global(t.chunk(pieces)[k], placement=spec.placement(stage), sbp=sbp))
    return out


def _batch_piece(mesh, sbp, rank: int) -> Tuple[int, int]:
    """(pieces, this rank's piece) of a batch split(0) over the mesh axes where `sbp` splits it."""
    grid = mesh if isinstance(mesh[0], tuple) else (mesh,)
    rows, cols = (len(grid), len(grid[0])) if len(sbp) == 2 else (1, len(grid[0]))
    i, j = next(((a, b) for a, row in enumerate(grid) for b, r in enumerate(row) if r == rank), (0, 0))
    split = [s == S0 for s in sbp] if len(sbp) == 2 else [False, sbp[0] == S0]
    n0, n1 = (rows if split[0] else 1), (cols if split[1] else 1)
    return n0 * n1, (i if split[0] else 0) * n1 + (j if split[1] else 0)


def expert_bytes(model, optimizer=None) -> Dict[str, int]:
    """Bytes of each experts parameter: the model's, or the ones `optimizer` holds (after a
    graph's first call, this rank's local components of its stages' parameters)."""
    held = None if optimizer is None else {id(p) for g in optimizer.param_groups for p in g["params"]}
    return {n: p.numel() * p.element_size() for n, p in model.named_parameters()
            if ".experts." in n and (held is None or id(p) in held)}


def train(kind: str, layout: str, data, accumulation: int = 1, skewed: bool = False, zero: int = 0, **config):
    """Each rank's (losses, expert parameter bytes it holds, graph) and rank 0's full state."""
    def rank_main(rank: int):
        model = model_of(kind, skewed, **config)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        graph = MoEGraph(model, layout, accumulation, optimizer, zero)
        losses = [graph(*local_inputs(layout, rank, *d)).to_local() for d in data]
        losses = [float(x) if x.numel() else None for x in losses]
        held = expert_bytes(model, None if zero else optimizer)   # ZeRO: the optimizer holds rows
        if zero:   # this rank's stages' experts only
            mine = {n for s in graph.plan.local_stages for n, _ in graph.compiled.programs[s].module.named_parameters()}
            held = {n: b for n, b in held.items() if f"model.{n}" in mine}
        return losses, held, graph, graph.full_state_dict(rank0_only=True)
    return LocalWorld(LAYOUTS[layout].nproc).run(rank_main)


def eager(kind: str, data, skewed: bool = False, **config):
    model = model_of(kind, skewed, **config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for ids, labels in data:
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(), loss.backward(), opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, expert_bytes(model)


def check(kind: str, layout: str, accumulation: int = 1, skewed: bool = False, zero: int = 0,
          aux64: bool = False, rows: int = B, steps: int = 2, **config):
    """graphc on the layout equals eager (losses at 8 float32 eps, parameters at 1e-10), and
    each rank holds 1/ep of the experts' bytes. Returns the ranks' graphs. aux64: the router's
    aux loss in float64 (switch_loss_float64), so parameters hold 1e-10 with it too."""
    data = batches(steps, rows=rows)
    with aux_in_float64() if aux64 else nullcontext():
        results = train(kind, layout, data, accumulation, skewed, zero, **config)
        want_losses, want_state, whole_bytes = eager(kind, data, skewed, **config)
    ep = _expert_ranks(layout)
    for rank, (losses, held, _, _) in enumerate(results):
        assert (bool(held) or rank not in _holding_experts(layout)) and all(nbytes * ep == whole_bytes[n] for n, nbytes in held.items()), \
            f"{layout} rank {rank}: {held} of the experts' bytes, {whole_bytes} whole"
        if losses[0] is not None:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=LOSS_RTOL, atol=0)
    state = results[0][3]
    for k, v in want_state.items():
        if config.get("aux", True) and not aux64:
            torch.testing.assert_close(state[k], v, rtol=0, atol=AUX_ATOL, msg=lambda m, k=k: f"{kind} {layout}: {k}: {m}")
        else:
            assert_close(state[k], v, f"{kind} {layout}: {k}")
    return [graph for _, _, graph, _ in results]


def _holding_experts(layout: str) -> set:
    """The ranks of the stages that hold a MoE layer (zbv: not those of the first and last)."""
    spec = LAYOUTS[layout]
    if len(spec.stages) == 1:
        return set(range(spec.nproc))
    stages = {s for path, s in spec.stage_of if path.startswith("model.layers.")}
    return {r for s in stages for r in graphc.placement("cpu", list(spec.stages[s])).flat_ranks}


def _expert_ranks(layout: str) -> int:
    spec = LAYOUTS[layout]
    mesh = spec.stages[0]
    if isinstance(mesh[0], tuple):
        axis = next(a for a, s in enumerate(spec.experts) if s == S0)
        return len(mesh) if axis == 0 else len(mesh[0])
    return len(mesh)


def exchanges(graph, microbatch: int = 0) -> Dict[str, list]:
    """Rank 0's expert-parallel all-to-alls of one micro-batch, per layer and direction."""
    from graphc.plan.instructions import Collective
    found: Dict[str, list] = {}
    for ins in graph.compiled.plans[0].instructions:
        if isinstance(ins, Collective) and ins.microbatch == microbatch and "expert parallel" in ins.note:
            layer, what = ins.note.split("expert parallel ")[1].split(": ")
            found.setdefault(f"{layer} {ins.direction}", []).append((ins.kind, what))
    return found


# -- by default: ep2 at accumulation 2 with the router's aux loss (the rest: -m slow) ---------

def test_mixtral_ep2_trains_as_eager_with_its_exchanges(tmp_path, monkeypatch):
    """Mixtral on 2 ranks, the batch and the experts split over both, its router's aux loss
    on (in float64): equal to eager on the whole batch at accumulation 2 (the micro-batches
    read the whole batch's token counts from the routing pre-pass, See NOTE: Whole-batch
    sums), each rank holding half the experts' bytes, and per MoE layer and micro-batch 3
    all-to-alls forward (counts, tokens, back) and 2 backward (back, tokens); the pre-pass
    (P) runs layer 0's forward exchanges, since layer 1's router reads its output. The first
    step's routing is recorded (NOTE: Routing log) as eager routes those rows. One step here
    (the aux matrix below runs two)."""
    monkeypatch.setenv("GRAPHC_ROUTING_OUT", str(tmp_path))
    graphs = check("mixtral", "ep2", accumulation=2, aux64=True, steps=1)   # 2 steps: -m slow
    assert graphs[0].compiled.programs[0].prologue is not None
    assert_routing_recorded(read_routing(str(tmp_path)), graphs[0].compiled.plans)
    for microbatch in (0, 1):
        found = exchanges(graphs[0], microbatch)
        assert len(found) == 5 and "model.model.layers.1.mlp.experts P" not in found, found
        for key, ops in found.items():
            want = [("all_to_all", w) for w in (("back", "tokens") if key.endswith("B")
                                                else ("counts", "tokens", "back"))]
            assert ops == want, (key, ops)


def assert_routing_recorded(routing, plans) -> None:
    """Each rank's recorded counts of the first step are eager's routing of its micro-batch's
    rows (ep2: rank r holds rows 4r..4r+3, micro-batch b two of them), and the plans priced by
    them scale each token exchange by its busiest member's load."""
    model = model_of("mixtral")
    ids = batches()[0][0]
    for rank in (0, 1):
        for mb in (0, 1):
            rows = ids.chunk(2)[rank].chunk(2)[mb]
            want = routed_counts(model, rows)
            got = {layer: per_mb[mb] for layer, per_mb in routing[rank].items()}
            assert got == want, (rank, mb, got, want)
    priced = routed_plans(plans, routing)
    for before, after in zip(plans[0].instructions, priced[0].instructions):
        if "expert parallel" in getattr(before, "note", "") and not before.note.endswith("counts"):
            layer = before.note.split("expert parallel ")[1].split(": ")[0]
            factor = load_factor(routing, layer, before.microbatch, before.ranks)
            assert after.nbytes == round(before.nbytes * factor) and factor >= 1.0
    table = routing_table(plans, routing, "recorded")
    assert "model.model.layers.1.mlp.experts" in table and "busiest / balanced" in table


def routed_counts(model, ids) -> Dict[str, list]:
    """Eager's tokens per expert of each experts module for `ids` (bincount of top_k_index)."""
    found = {}
    hooks = [layer.mlp.experts.register_forward_hook(
        lambda m, args, out, i=i: found.__setitem__(
            f"model.model.layers.{i}.mlp.experts",
            torch.bincount(args[1].flatten(), minlength=m.num_experts).tolist()))
        for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return found


def test_ranks_disagreeing_on_an_exchange_are_refused_naming_rank_and_layer():
    """Every rank of an expert group posts the same exchanges: the verifier pairs them, so
    a plan where rank 1 lacks layer 0's token exchange is a GraphcError naming rank 1 and
    the layer, before anything runs (a mismatch could otherwise hang the all-to-all)."""
    from graphc.plan.verify import verify_plans
    inputs = [global_input(t, P01, S0) for t in batches(1)[0]]
    compiled = compile_graph(MoEGraph(model_of("mixtral", aux=False), "ep2"), inputs, 2)
    verify_plans(compiled.plans, 2)
    plan = compiled.plans[1]
    tokens = next(i for i, ins in enumerate(plan.instructions)
                  if "model.model.layers.0.mlp.experts: tokens" in getattr(ins, "note", ""))
    del plan.instructions[tokens]
    with pytest.raises(graphc.GraphcError, match=r"missing on rank 1") as info:
        verify_plans(compiled.plans, 2)
    assert "expert parallel model.model.layers.0.mlp.experts: tokens" in str(info.value)


def test_experts_that_do_not_divide_over_the_ranks_are_refused():
    """3 experts on 2 ranks: each rank would not hold the same number, and gathering them
    would hold every expert everywhere, so the declaration is refused naming the layer."""
    inputs = [global_input(t, P01, S0) for t in batches(1)[0]]
    graph = MoEGraph(model_of("mixtral", experts=3, aux=False), "ep2")
    with pytest.raises(graphc.GraphcError, match=r"experts 'model.model.layers.0.mlp.experts'.*3 experts do not divide"):
        compile_graph(graph, inputs, 2)


# -- the wider matrix: the router's aux loss as transformers computes it (float32) at accumulation
# 1 and 2 (pipelines: without it at 2), and in float64 at 1e-10 at accumulation 2 and 4 ---------

MATRIX = [(kind, layout, acc) for kind in ("mixtral", "qwen3_moe")
          for layout in ("ep2", "ep4", "dp2xep2", "pp2xep2", "tp2xep2") for acc in (1, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("kind,layout,accumulation", MATRIX)
def test_moe_layouts_train_as_eager(kind, layout, accumulation):
    check(kind, layout, accumulation)


AUX_MATRIX = [(kind, layout, acc) for kind in ("mixtral", "qwen3_moe") for layout in ("ep2", "dp2xep2")
              for acc in (2, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("kind,layout,accumulation", AUX_MATRIX)
def test_router_aux_loss_in_float64_is_exact_under_accumulation(kind, layout, accumulation):
    """The Switch aux loss's mathematics at 1e-10: f_e (token counts) of the whole batch from
    the pre-pass times each micro-batch's P_e (router probabilities), on 16 rows (dp2 x ep2
    at accumulation 4: 2 rows per rank and micro-batch)."""
    check(kind, layout, accumulation, aux64=True, rows=16)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_skewed_router_with_empty_exchanges(kind):
    """Every token routed to experts 0 and 1: on ep2 rank 1 receives no token and sends none
    back, and the step still equals eager (with the aux loss in float64, accumulation 2)."""
    assert experts_hit(model_of(kind, skewed=True), batches()[0][0]) == {0, 1}
    check(kind, "ep2", accumulation=2, skewed=True, aux64=True)


def experts_hit(model, ids) -> set:
    """The experts any token of `ids` is routed to, in any layer (eager)."""
    hit = set()
    hooks = [layer.mlp.experts.register_forward_hook(lambda m, args, out: hit.update(args[1].flatten().tolist()))
             for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return hit


@pytest.mark.slow
@pytest.mark.fp32
def test_default_grouped_mm_experts_in_float32_on_ep2():
    """transformers' default experts (grouped_mm), float32 as they come: traced as moe_experts,
    trained on ep2 at accumulation 2 against eager's own grouped_mm (measured: losses 1 ulp
    apart, parameters 7e-9 relative), compared at 8 float32 eps."""
    data = batches()
    config = dict(dtype=torch.float32, impl="grouped_mm", aux=False)
    results = train("mixtral", "ep2", data, 2, **config)
    want_losses, want_state, _ = eager("mixtral", data, **config)
    torch.testing.assert_close(torch.tensor(results[0][0]), torch.tensor(want_losses), rtol=LOSS_RTOL, atol=0)
    for k, v in want_state.items():
        torch.testing.assert_close(results[0][3][k], v, rtol=LOSS_RTOL, atol=LOSS_RTOL)


@pytest.mark.slow
def test_zero1_on_dp2xep2():
    """ZeRO stage 1 beside expert parallelism: each parameter's optimizer rows are split over
    the ranks holding the same values (the experts over the data axis only: REDUCE_SCATTER
    over ranks [0, 2]; every other parameter, its gradient partial over both axes, over their
    joint group [0, 1, 2, 3]: See NOTE: ZeRO over joint axes), and the step equals eager."""
    graphs = check("mixtral", "dp2xep2", accumulation=2, zero=1, aux=False)
    scatters = [ins for ins in graphs[0].compiled.plans[0].instructions if type(ins).__name__ == "ReduceScatter"]
    experts = [ins for ins in scatters if "experts" in str(ins)]
    assert experts and all(tuple(ins.ranks) == (0, 2) for ins in experts), [str(i) for i in scatters]
    rest = [t.name for ins in scatters if tuple(ins.ranks) == (0, 1, 2, 3) for t in ins.tensors]
    assert rest and not [t for t in rest if "experts" in t], [str(i) for i in scatters]


def _gloo_worker(rank, world, kind, skewed):
    model = model_of(kind, skewed, aux=False)
    graph = MoEGraph(model, "ep2", accumulation=2)
    losses = [graph(*local_inputs("ep2", rank, *d)).to_local().item() for d in batches()]
    return losses, {k: v.clone() for k, v in graph.full_state_dict().items()}


@pytest.mark.slow
@pytest.mark.world
def test_skewed_mixtral_ep2_on_gloo():
    """Real processes on gloo: the exchanges with per-rank split sizes, empty ones included
    (the skewed router sends rank 1 no token), equal eager at accumulation 2."""
    data = batches()
    want_losses, want_state, _ = eager("mixtral", data, skewed=True, aux=False)
    for losses, state in run_world(_gloo_worker, 2, "mixtral", True):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=LOSS_RTOL, atol=0)
        for k, v in want_state.items():
            assert_close(state[k], v, f"gloo ep2: {k}")


@pytest.mark.slow
def test_graphc_check_of_the_moe_example_on_pp2_dp2_ep2():
    """`graphc check` runs examples/moe.py's 8 ranks (2 stages, each a data 2 x expert 2 grid)
    and exits 0 with every step equal to eager on the whole batch."""
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "graphc", "check", "examples/moe.py", "--nproc", "8", "--steps", "2",
           "--", "--pp", "2", "--dp", "2", "--ep", "2"]
    ok = subprocess.run(cmd, cwd=root, env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True,
                        text=True, timeout=600)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "OK: 2 step(s)" in ok.stdout and "graphc check: OK" in ok.stdout


@pytest.mark.slow
def test_routing_recorded_by_graphc_check_prices_graphc_plan_simulate(tmp_path):
    """The histogram from a real batch, end to end: `graphc check` of examples/moe.py on ep2
    records the first step's routing (GRAPHC_ROUTING_OUT), and `graphc plan --simulate
    --routing` prints every MoE layer's tokens per expert per step (8 x 16 tokens, 2 slots
    each: 256 pairs) and the busiest member against the balanced load."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), GRAPHC_ROUTING_OUT=str(tmp_path / "routing"))
    example = ["examples/moe.py", "--nproc", "2"]
    ok = subprocess.run([sys.executable, "-m", "graphc", "check", *example, "--steps", "1", "--", "--ep", "2"],
                        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    del env["GRAPHC_ROUTING_OUT"]
    ok = subprocess.run([sys.executable, "-m", "graphc", "plan", *example, "--out", str(tmp_path / "plans"),
                         "--simulate", "cpu", "--routing", str(tmp_path / "routing"), "--no-chart", "--", "--ep", "2"],
                        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    rows = [line.split() for line in ok.stdout.splitlines() if line.startswith("model.model.layers.")]
    assert [r[0] for r in rows] == [f"model.model.layers.{i}.mlp.experts" for i in (0, 1)], ok.stdout
    for row in rows:
        assert sum(int(c) for c in row[1:5]) == 8 * 16 * 2 and float(row[5]) > 0, row
    assert "with balanced expert exchanges" in ok.stdout


class MaskedMoEGraph(MoEGraph):
    """With a padding mask: the aux loss's masked branch (counts scattered in place, rows
    counted by the mask)."""

    def build(self, ids, labels, mask):
        out = self.model(input_ids=ids, labels=labels, attention_mask=mask)
        out.loss.backward()
        return out.loss


@pytest.mark.slow
def test_router_aux_loss_with_a_padding_mask_under_accumulation():
    """transformers' masked aux loss (as it comes, float32) on ep2 at accumulation 2, rows 1 and
    6 padded at their ends: equal to eager (measured 1.4e-17 on the parameters)."""
    data = batches()
    masks = [torch.ones_like(ids) for ids, _ in data]
    for m in masks:
        m[1, 4:], m[6, 3:] = 0, 0

    def rank_main(rank: int):
        model = model_of("mixtral")
        graph = MaskedMoEGraph(model, "ep2", 2, torch.optim.SGD(model.parameters(), lr=0.1))
        losses = [graph(*local_inputs("ep2", rank, ids, labels),
                        global_input(m, P01, S0, rank)).to_local().item()
                  for (ids, labels), m in zip(data, masks)]
        return losses, graph.full_state_dict(rank0_only=True)
    results = LocalWorld(2).run(rank_main)
    model = model_of("mixtral")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    for (ids, labels), m in zip(data, masks):
        loss = model(input_ids=ids, labels=labels, attention_mask=m).loss
        opt.zero_grad(), loss.backward(), opt.step()
        want.append(loss.item())
    torch.testing.assert_close(torch.tensor(results[0][0]), torch.tensor(want), rtol=LOSS_RTOL, atol=0)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(results[0][1][k], v, rtol=0, atol=AUX_ATOL, msg=lambda m, k=k: f"{k}: {m}")
