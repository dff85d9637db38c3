"""Context parallelism (config.set_context_parallel; NOTE: Context parallel).

Numerics (local world, every rank a thread; float64, tolerance 1e-10, the oracle of
helpers.py and graphc.testing's checked steps): a nanoGPT block stack with causal SDPA and
examples/hf_llama.py's Llama (as it comes: padded rows, attention_mask, labels=) with the
sequence split over 2 (and 4) ranks, ring and all_to_all, equal eager on the whole batch;
a non-causal encoder with a key-padding mask; data x context and tensor x context on 2-D
meshes. Plan level: the ring's n-1 key/value exchanges per attention are counted, the
verifier refuses a ring whose ranks disagree on a step, and a seeded error in the ring's
merge fails the check against eager.
"""
import dataclasses
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from graphc.errors import PlanError
from graphc.ops import context_parallel as cp_ops
from graphc.plan.instructions import Collective
from graphc.plan.verify import verify_plans
from graphc.runtime.local_world import LocalWorld
from gpt_block_models import BlockStack, TokenLossGraph, token_loss
from layouts import fallbacks, replicated
from helpers import (assert_same_as_eager, compile_graph, eager_train, feed_split, global_input, graphc_train,
                     run_world)
from models import OPTIMIZERS

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))

STEPS = 2
BATCH, T, D_IN = 2, 8, 8
P01 = graphc.placement("cpu", [0, 1])


def _batches(batch=BATCH, t=T):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(batch, t, D_IN, generator=g), torch.randint(0, 5, (batch, t), generator=g))
            for _ in range(STEPS)]


def _stack_graph(method: str, where, kind: str = "sdpa", model_sbp=sbp.broadcast):
    torch.manual_seed(0)
    model = BlockStack(layers=2, kind=kind, block=16)
    graphc.to_global(model, placement=where, sbp=model_sbp)
    graph = TokenLossGraph(model, OPTIMIZERS["sgd_momentum"](model.parameters()))
    graph.config.set_context_parallel(method=method)
    return graph


def _eager(batches, kind: str = "sdpa"):
    torch.manual_seed(0)
    return eager_train(BlockStack(layers=2, kind=kind, block=16), OPTIMIZERS["sgd_momentum"], None,
                       token_loss, batches, STEPS)


def _exchanges(plan, direction: str):
    return [(i.node, i.kind, i.note) for i in plan.instructions
            if isinstance(i, Collective) and i.direction == direction and "scaled_dot" in i.node]


def _train_cp2(method: str):
    def train(rank):
        graph = _stack_graph(method, P01)
        losses, state = graphc_train(graph, _batches(), feed=feed_split(P01, rank, sbp.split(1)))
        return losses, state, graph.plan
    results = LocalWorld(2).run(train)
    ref_losses, ref_state = _eager(_batches())
    for rank, (losses, state, plan) in enumerate(results):
        assert_same_as_eager(losses, state, ref_losses, ref_state, f"cp2 {method} rank {rank}")
    return results[0][2]


@pytest.mark.slow   # CI time: the balanced ring in test_balanced_ring_returns_tokens_in_order
def test_ring_cp2_matches_eager():
    """The causal block stack with its sequence split over 2 contiguous shards."""
    plan = _train_cp2("ring")
    # per attention n-1 = 1 key/value exchange forward; backward 1 more with the gradients,
    # and the exchange that hands dk, dv home
    for layer in ("scaled_dot_product_attention", "scaled_dot_product_attention_1"):
        assert [k for n, k, _ in _exchanges(plan, "F") if n == layer] == ["send_recv"]
        assert [k for n, k, _ in _exchanges(plan, "B") if n == layer] == ["send_recv"] * 2
    # nothing is gathered for attention: the only other forward collectives are the loss's
    assert not [i for i in plan.instructions if isinstance(i, Collective) and i.kind == "all_gather"
                and i.direction == "F"]


class LogitsGraph(TokenLossGraph):
    """The token loss, and the per-token logits returned beside it (split along the sequence)."""

    def build(self, x, y):
        logits = self.model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        return loss, logits


def test_balanced_ring_returns_tokens_in_order():
    """load_balance=True with is_causal SDPA (the default check of the block stack's ring; the
    contiguous ring runs by default in the seeded-error test): the causal pairs by true
    position, and the per-token logits come back as the user split the input (rank k:
    positions chunk k), equal to eager's whole-sequence logits; the loss and parameters equal
    eager's; per attention one k, v exchange forward, two backward, nothing gathered."""
    x, y = _batches()[0]

    def train(rank):
        torch.manual_seed(0)
        model = BlockStack(layers=2, block=16)
        graphc.to_global(model, placement=P01, sbp=sbp.broadcast)
        graph = LogitsGraph(model, OPTIMIZERS["sgd_momentum"](model.parameters()))
        graph.config.set_context_parallel(method="ring", load_balance=True)
        loss, logits = graph(*feed_split(P01, rank, sbp.split(1))(x, y))
        assert logits.sbp == (sbp.split(1),), logits.sbp   # returned split, not gathered
        for layer in ("scaled_dot_product_attention", "scaled_dot_product_attention_1"):
            assert [k for n, k, _ in _exchanges(graph.plan, "F") if n == layer] == ["send_recv"]
            assert [k for n, k, _ in _exchanges(graph.plan, "B") if n == layer] == ["send_recv"] * 2
        notes = [i.note for i in graph.plan.instructions if isinstance(i, Collective)]
        assert notes.count("load balance: dealt zig-zag") == 2 and \
            notes.count("load balance: dealt back in order") == 2, notes   # x, y in; logits out (and its gradient)
        return loss.to_local().item(), logits.to_local().detach(), graph.full_state_dict()
    results = LocalWorld(2).run(train)
    torch.manual_seed(0)
    model = BlockStack(layers=2, block=16)
    ref_logits = model(x).detach()
    ref_losses, ref_state = eager_train(model, OPTIMIZERS["sgd_momentum"], None, token_loss, [(x, y)], 1)
    for rank, (loss, logits, state) in enumerate(results):
        assert_same_as_eager([loss], state, ref_losses, ref_state, f"balanced cp2 rank {rank}")
        torch.testing.assert_close(logits, ref_logits.chunk(2, 1)[rank], atol=1e-10, rtol=1e-10)


@pytest.mark.slow   # CI time: the ring in test_ring_cp2_matches_eager
def test_all_to_all_cp2_matches_eager():
    plan = _train_cp2("all_to_all")
    for layer in ("scaled_dot_product_attention", "scaled_dot_product_attention_1"):
        assert [w for n, _, w in _exchanges(plan, "F") if n == layer] == [f"ulysses {x}" for x in ("q", "k", "v", "out")]
        assert [w for n, _, w in _exchanges(plan, "B") if n == layer] == [f"ulysses {x}" for x in ("out", "v", "k", "q")]


def test_ring_exchanges_per_attention_on_cp4():
    """n-1 key/value exchanges per attention forward, n backward (plan of 4 ranks, one process)."""
    p = graphc.placement("cpu", [0, 1, 2, 3])
    x, y = _batches(t=16)[0]
    cg = compile_graph(_stack_graph("ring", p), [global_input(x, p, sbp.split(1)), global_input(y, p, sbp.split(1))], 4)
    for plan in cg.plans:
        fwd, bwd = _exchanges(plan, "F"), _exchanges(plan, "B")
        assert len(fwd) == 2 * 3 and len(bwd) == 2 * 4, (fwd, bwd)
        assert {k for _, k, _ in fwd + bwd} == {"send_recv"}
        sent = [i.nbytes for i in plan.instructions if isinstance(i, Collective) and i.note.startswith("ring step")
                and i.direction == "F"]
        assert set(sent) == {2 * BATCH * 4 * 4 * 4 * 8}   # k and v: [B, H, T/4, E] float64 each
    verify_plans(cg.plans)


def test_verifier_refuses_a_ring_step_missing_on_one_rank():
    x, y = _batches()[0]
    cg = compile_graph(_stack_graph("ring", P01), [global_input(x, P01, sbp.split(1)),
                                                   global_input(y, P01, sbp.split(1))], 2)
    plan = cg.plans[1]
    step = next(i for i, ins in enumerate(plan.instructions) if isinstance(ins, Collective) and ins.kind == "send_recv")
    plan.instructions[step] = dataclasses.replace(plan.instructions[step], note="x", node="other")
    with pytest.raises(PlanError):
        verify_plans(cg.plans)


def _wrong_merge(out, lse, block_out, block_lse):
    """The right merge plus a millionth of the running output (a seeded error)."""
    merged, new = cp_ops.__dict__["_right_merge"](out, lse, block_out, block_lse)
    return merged + out * 1e-6, new


def _checked_stack(t: int = T):
    """The block stack on cp2 ring, its step checked against eager (graphc check's oracle)."""
    x, y = _batches(t=t)[0]
    return graphc.testing.local_world(lambda: _stack_graph("ring", P01),
                                      lambda rank, step: (global_input(x, P01, sbp.split(1), rank),
                                                          global_input(y, P01, sbp.split(1), rank)),
                                      2, steps=1, check=True)


def test_a_seeded_error_in_the_ring_merge_fails_the_check(monkeypatch):
    monkeypatch.setattr(cp_ops, "_right_merge", cp_ops.merge, raising=False)
    monkeypatch.setattr(cp_ops, "merge", _wrong_merge)
    run = _checked_stack()
    assert not run.ok and "DIFFERS: first at step 0" in run.text(), run.text()
    monkeypatch.setattr(cp_ops, "merge", cp_ops._right_merge)
    run = _checked_stack(t=7)   # and the right merge passes, on uneven shards (4 and 3 positions)
    assert run.ok, run.text()


# -- Hugging Face Llama ---------------------------------------------------------------------
def _llama_batch(t: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (2, t), generator=g)
    mask = (torch.arange(t)[None] < torch.tensor([t - 3, t])[:, None]).long()   # a padded row
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _qwen2(t: int):
    import transformers
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=t, use_cache=False))


def _llama(n: int, method: str, steps: int = 2, t: int = 12, load_balance: bool = False, arch: str = "llama"):
    """examples/hf_llama.py's LlamaForCausalLM (or a Qwen2ForCausalLM as it comes, its q, k, v
    with biases) with every input's sequence split over n ranks, every step checked against
    eager at 1e-10 (graphc.testing.local_world)."""
    pytest.importorskip("transformers")
    import hf_llama
    from gpt import Layout
    args = type("Args", (), dict(seed=0, embd=32, layers=2, heads=4, block=t))
    batch = _llama_batch(t)
    where = graphc.placement("cpu", list(range(n)))

    def make():
        model = hf_llama.make_model(64, args) if arch == "llama" else _qwen2(t)
        graph = hf_llama.LlamaGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), Layout(1, 1, 1), 1)
        graph.model.config.set_stage(0, where)
        graph.config.set_context_parallel(method=method, load_balance=load_balance)
        return graph

    def inputs(rank, step):
        return ({k: global_input(v, where, sbp.split(1), rank) for k, v in batch.items()},)
    return graphc.testing.local_world(make, inputs, n, steps=steps, check=True)


def _counting_scores(monkeypatch) -> dict:
    """Counts the attention scores each rank's ring computes (query x key elements of the
    pairs not skipped), by rank: the causal work balance."""
    work = {}
    right = cp_ops.pair_scores

    def counted(q, kb, mask, pair, scale):
        s = right(q, kb, mask, pair, scale)
        if s is not None:
            rank = graphc.world.rank()
            work[rank] = work.get(rank, 0) + pair.q_len * pair.k_len
        return s
    monkeypatch.setattr(cp_ops, "pair_scores", counted)
    return work


def test_hf_llama_cp2_balanced_ring_matches_eager(monkeypatch):
    """load_balance=True on HF Llama (its explicit causal-and-padding mask): rank k holds
    chunks k and 3-k of 4, and both ranks compute the same number of scores (contiguous
    shards: rank 0 sees only its own block, 36 of rank 1's 72 per head and step)."""
    work = _counting_scores(monkeypatch)
    run = _llama(2, "ring", load_balance=True)
    assert run.ok, run.text()
    assert len(work) == 2 and work[0] == work[1], work
    plan = run.graphs[0].plan
    assert len(_exchanges(plan, "F")) == 2   # 2 layers, one ring step each
    redealt = [i for i in plan.instructions if isinstance(i, Collective) and "dealt zig-zag" in i.note]
    assert len(redealt) == 3, [str(i) for i in plan.instructions]   # input_ids, attention_mask, labels
    # HF's padding mask read as padding_mask[batch_idx, kv_idx] has a rule (sbp/tensor_index.py):
    # gathered as a [B, T] input of a whole-inputs signature, not an op without one
    assert fallbacks(run.graphs[0]) == [] and replicated(run.graphs[0]) == {0: 0.0}


@pytest.mark.slow   # CI time: HF Llama's balanced ring runs by default; Qwen2 differs by its q, k, v biases
@pytest.mark.parametrize("method,load_balance", [("ring", False), ("all_to_all", False), ("ring", True)])
def test_hf_qwen2_cp2_matches_eager(method, load_balance):
    run = _llama(2, method, load_balance=load_balance, arch="qwen2")
    assert run.ok, run.text()
    assert len(_exchanges(run.graphs[0].plan, "F")) == (2 if method == "ring" else 2 * 4)   # per layer


@pytest.mark.slow   # CI time: the balanced ring in test_hf_llama_cp2_balanced_ring_matches_eager
def test_contiguous_ring_work_is_uneven(monkeypatch):
    work = _counting_scores(monkeypatch)
    run = _llama(2, "ring")
    assert run.ok, run.text()
    assert work[1] == 2 * work[0], work   # rank 1 attends to both blocks, rank 0 to its own


@pytest.mark.slow   # CI time: the balanced ring in test_hf_llama_cp2_balanced_ring_matches_eager
@pytest.mark.parametrize("n,method,load_balance", [(2, "all_to_all", False), (4, "ring", False),
                                                   (4, "all_to_all", False), (2, "all_to_all", True),
                                                   (4, "ring", True), (4, "all_to_all", True)])
def test_hf_llama_context_parallel_matches_eager(n, method, load_balance):
    run = _llama(n, method, t=16, load_balance=load_balance)
    assert run.ok, run.text()


# -- a non-causal encoder -------------------------------------------------------------------
class Encoder(nn.Module):
    """BERT-style self-attention over padded rows: an additive key-padding mask, no causality."""

    def __init__(self, c: int = 16, heads: int = 4, classes: int = 3):
        super().__init__()
        self.heads = heads
        self.inp, self.qkv, self.out = nn.Linear(D_IN, c), nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.norm, self.head = nn.LayerNorm(c), nn.Linear(c, classes)

    def forward(self, x, keep):
        h = self.inp(x)
        b, t, c = h.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(h).split(c, 2))
        mask = torch.zeros(keep.shape, dtype=h.dtype).masked_fill(keep == 0, float("-inf"))[:, None, None, :]
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = self.norm(h + self.out(a.transpose(1, 2).reshape(b, t, c)))
        return self.head(h)


class EncoderGraph(graphc.Graph):
    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.add_optimizer(opt)

    def build(self, x, keep, y):
        loss = F.mse_loss(self.model(x, keep), y)
        loss.backward()
        return loss


def test_non_causal_encoder_cp2_matches_eager():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(BATCH, T, D_IN, generator=g), torch.randn(BATCH, T, 3, generator=g)
    keep = (torch.arange(T)[None] < torch.tensor([T, T - 3])[:, None]).long()
    batches = [(x, keep, y)] * STEPS

    def train(rank):
        torch.manual_seed(0)
        model = Encoder()
        graphc.to_global(model, placement=P01, sbp=sbp.broadcast)
        graph = EncoderGraph(model, OPTIMIZERS["sgd_momentum"](model.parameters()))
        graph.config.set_context_parallel(method="ring")
        losses, state = graphc_train(graph, batches, feed=feed_split(P01, rank, sbp.split(1)))
        return losses, state, graph.plan
    results = LocalWorld(2).run(train)
    torch.manual_seed(0)
    ref_losses, ref_state = _eager_encoder(Encoder(), batches)
    for rank, (losses, state, plan) in enumerate(results):
        assert_same_as_eager(losses, state, ref_losses, ref_state, f"encoder cp2 rank {rank}")
        assert [k for _, k, _ in _exchanges(plan, "F")] == ["send_recv"]


def _eager_encoder(model, batches):
    opt = OPTIMIZERS["sgd_momentum"](model.parameters())
    losses = []
    for x, keep, y in batches:
        loss = F.mse_loss(model(x, keep), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow   # ~3 s: the ring's float64 numbers run by default
def test_ring_in_bfloat16_rounds_once_as_a_float32_kernel():
    """NOTE: Ring precision: bfloat16 q, k, v on a balanced cp2 ring give eager's float32
    attention on the whole sequence rounded once to bfloat16, forward and backward. The two
    float32 results differ by summation order only (~1e-7 relative), so a rounded element
    differs by at most one bfloat16 ulp (2**-7 of its value) and mostly not at all."""
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 4, 8, 8, generator=g, dtype=torch.float32).bfloat16() for _ in range(4))
    ref = [t.float().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=True)
    out.backward(dout.float())
    want = [out.bfloat16()] + [t.grad.bfloat16() for t in ref]

    def ring(rank):
        dealt = [t[:, :, [*range(2 * rank, 2 * rank + 2), *range(6 - 2 * rank, 8 - 2 * rank)]].requires_grad_()
                 for t in (q, k, v)]   # chunks rank and 3 - rank of 4 (load balance)
        o = cp_ops.context_parallel_attention(*dealt, None, ((0, 1),), "ring", 8, is_causal=True,
                                              load_balance=True)
        o.backward(dout[:, :, [*range(2 * rank, 2 * rank + 2), *range(6 - 2 * rank, 8 - 2 * rank)]])
        return [o.detach()] + [t.grad for t in dealt]
    got = LocalWorld(2).run(ring)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        whole = torch.cat([got[0][i][:, :, :2], got[1][i][:, :, :4], got[0][i][:, :, 2:]], 2)
        assert whole.dtype == torch.bfloat16
        torch.testing.assert_close(whole.float(), want[i].float(), rtol=2 ** -7, atol=1e-6, msg=name)
        assert (whole != want[i]).float().mean() < 0.05, name   # a flip is rare


def _fp32_sdpa(q, k, v, *args, **kwargs):
    """Eager attention doing the ring's casts: float32 inside, rounded once (NOTE: Ring precision)."""
    with torch.autocast("cpu", enabled=False):
        return _SDPA(q.float(), k.float(), v.float(), *args, **kwargs).to(q.dtype)


_SDPA = F.scaled_dot_product_attention
U = 2.0 ** -8   # bfloat16's unit roundoff


@pytest.mark.slow   # ~6 s: AMP beside the balanced ring
@pytest.mark.fp32
def test_bf16_amp_on_balanced_cp2_matches_eager_autocast(monkeypatch):
    """enable_amp(bf16) on the balanced cp2 ring against eager autocast doing the same casts
    (attention in float32, rounded once), one SGD step, eager on one thread as each rank runs
    (CPU bf16 kernels, LayerNorm's backward among them, round by their thread count).
    Tolerances: the loss is a float32 token mean summed in another order: 16 terms,
    |d| <= 16 * 2**-24 |loss|. A parameter's gradient is a sum over positions that each rank
    rounds to bf16 before the float32 all-reduce where eager rounds once: per element
    |d g| <= u (|a_0| + |a_1| + |e|) + float32 terms (NOTE: Data parallel under autocast in
    tests/runtime/test_amp_data_parallel.py), u = 2**-8. Bounding |a_r| by the positions'
    sum of magnitudes needs each layer's |dY|^T |X|, not computed here: the check uses
    4 u lr max|g| per parameter tensor (measured 2.6-2.8 u; a lost or doubled contribution
    is ~1/16 of the gradient, 16 u)."""
    torch.set_default_dtype(torch.float32)
    lr = 2.0 ** -4
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(2, T, D_IN, generator=g), torch.randint(0, 5, (2, T), generator=g)

    def train(rank):
        torch.manual_seed(0)
        model = BlockStack(layers=2, block=16)
        graphc.to_global(model, placement=P01, sbp=sbp.broadcast)
        graph = TokenLossGraph(model, torch.optim.SGD(model.parameters(), lr=lr))
        graph.config.set_context_parallel(method="ring", load_balance=True)
        graph.config.enable_amp(True, dtype=torch.bfloat16)
        loss = graph(*feed_split(P01, rank, sbp.split(1))(x, y)).to_local().item()
        return loss, graph.full_state_dict()
    results = LocalWorld(2).run(train)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = BlockStack(layers=2, block=16)
        monkeypatch.setattr(F, "scaled_dot_product_attention", _fp32_sdpa)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = token_loss(model(x), y)
        monkeypatch.undo()
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        torch.optim.SGD(model.parameters(), lr=lr).step()
    finally:
        torch.set_num_threads(threads)
    for rank, (got_loss, state) in enumerate(results):
        assert abs(got_loss - loss.item()) <= 16 * 2.0 ** -24 * abs(loss.item()), (rank, got_loss, loss.item())
        for name, p in model.state_dict().items():
            bound = 4 * U * lr * grads[name].abs().max().item() if name in grads else 0.0
            assert (state[name] - p).abs().max().item() <= bound, (rank, name)


# -- options ----------------------------------------------------------------------------------
def test_set_context_parallel_refuses_what_it_cannot_do():
    graph = _stack_graph("ring", P01)
    with pytest.raises(graphc.GraphcError, match="method must be one of"):
        graph.config.set_context_parallel(method="ulysses")
    with pytest.raises(graphc.GraphcError, match="load_balance expects True or False"):
        graph.config.set_context_parallel(method="ring", load_balance=1)



def test_load_balance_refuses_a_sequence_not_divisible_by_2n():
    graph = _stack_graph("ring", P01)
    graph.config.set_context_parallel(method="ring", load_balance=True)
    x, y = _batches(t=6)[0]
    with pytest.raises(graphc.GraphcError, match="6 does not divide by 4.*Fix: pad the sequence"):
        compile_graph(graph, [global_input(x, P01, sbp.split(1)), global_input(y, P01, sbp.split(1))], 2)


# -- compositions -----------------------------------------------------------------------------
MESH = graphc.placement("cpu", [[0, 1], [2, 3]])


def _data_x_context(rank):
    """Rows over the mesh's first axis, the sequence over its second."""
    graph = _stack_graph("ring", MESH, model_sbp=(sbp.broadcast, sbp.broadcast))
    losses, state = graphc_train(graph, _batches(batch=4), feed=feed_split(MESH, rank, (sbp.split(0), sbp.split(1))))
    return losses, state, graph.plan


def _tensor_x_context(rank):
    """The sequence over the mesh's first axis, Megatron's heads and MLP over its second."""
    torch.manual_seed(0)
    model = BlockStack(layers=2, block=16)
    graphc.to_global(model, placement=MESH, sbp=(sbp.broadcast, sbp.broadcast))
    for block in model.blocks:
        for lin in (block.attn.c_attn, block.mlp.c_fc):
            graphc.to_global(lin, placement=MESH, sbp=(sbp.broadcast, sbp.split(0)))
        for lin in (block.attn.c_proj, block.mlp.c_proj):
            graphc.to_global(lin.weight, placement=MESH, sbp=(sbp.broadcast, sbp.split(1)))
    graph = TokenLossGraph(model, OPTIMIZERS["sgd_momentum"](model.parameters()))
    graph.config.set_context_parallel(method="ring")
    losses, state = graphc_train(graph, _batches(), feed=feed_split(MESH, rank, (sbp.split(1), sbp.broadcast)))
    return losses, state, graph.plan


@pytest.mark.slow   # CI time: cp2 alone in test_ring_cp2_matches_eager
@pytest.mark.parametrize("layout", ["dp2xcp2", "tp2xcp2"])
def test_context_parallel_on_a_2d_mesh_matches_eager(layout):
    batches = _batches(batch=4) if layout == "dp2xcp2" else _batches()
    results = LocalWorld(4).run(_data_x_context if layout == "dp2xcp2" else _tensor_x_context)
    ref_losses, ref_state = _eager(batches)
    for rank, (losses, state, plan) in enumerate(results):
        assert_same_as_eager(losses, state, ref_losses, ref_state, f"{layout} rank {rank}")
        ring = [i for i in plan.instructions if isinstance(i, Collective) and i.kind == "send_recv"]
        assert len(ring) == 2 * 1 + 2 * 2, [str(i) for i in ring]   # 2 layers: 1 step forward, 2 backward
        cp_axis = (rank - rank % 2, rank - rank % 2 + 1) if layout == "dp2xcp2" else (rank % 2, rank % 2 + 2)
        assert {i.ranks for i in ring} == {cp_axis}, (rank, {i.ranks for i in ring})


def _one_row_per_data_rank(rank):
    graph = _stack_graph("ring", MESH, model_sbp=(sbp.broadcast, sbp.broadcast))
    losses, state = graphc_train(graph, _batches(batch=2), feed=feed_split(MESH, rank, (sbp.split(0), sbp.split(1))))
    return losses, state, graph.plan


def test_one_row_per_data_rank_flattens_its_tokens_in_place():
    """NOTE: Nested shards: dp2 x cp2 with 2 rows (long sequences come a row or two at a
    time): the loss's view(-1, V) of (split(0), split(1)) logits is each rank's own tokens,
    (split(0), split(0)) of the flat tokens, with no exchange. It was refused: the context
    axis judged the whole batch (2 rows: divisible by 2) and re-split it by rows, 1 row in 2."""
    results = LocalWorld(4).run(_one_row_per_data_rank)
    ref_losses, ref_state = _eager(_batches(batch=2))
    for rank, (losses, state, plan) in enumerate(results):
        assert_same_as_eager(losses, state, ref_losses, ref_state, f"dp2 x cp2, 2 rows, rank {rank}")
        boxes = [str(i) for i in plan.instructions if isinstance(i, Collective) and i.kind == "all_to_all"]
        assert boxes == [], boxes


def _zero2_data_x_context(rank):
    """dp2 x cp2 with ZeRO-2 and the sequence dealt zig-zag. Every gradient is partial over
    both axes (rows and positions): ZeRO reduce-scatters it over their joint group, ranks 0-3
    (See NOTE: ZeRO over joint axes in graphc/runtime/zero.py)."""
    graph = _stack_graph("ring", MESH, model_sbp=(sbp.broadcast, sbp.broadcast))
    graph.config.set_context_parallel(method="ring", load_balance=True)
    graph.config.enable_zero(True, stage=2, shard_min_size=1)
    losses, state = graphc_train(graph, _batches(batch=4), feed=feed_split(MESH, rank, (sbp.split(0), sbp.split(1))))
    return losses, state, graph.plan


@pytest.mark.slow   # CI time: HF Llama's dp2 x cp2 ZeRO-2 in tests/zero/test_zero_joint_axes.py
def test_zero2_on_data_x_balanced_context_matches_eager():
    results = LocalWorld(4).run(_zero2_data_x_context)
    ref_losses, ref_state = _eager(_batches(batch=4))
    for rank, (losses, state, plan) in enumerate(results):
        assert_same_as_eager(losses, state, ref_losses, ref_state, f"dp2 x cp2 zero2 rank {rank}")
        assert not [i for i in plan.instructions if type(i).__name__ == "AllReduce"], str(plan)
        scattered = {i.ranks for i in plan.instructions if type(i).__name__ == "ReduceScatter"}
        assert scattered == {(0, 1, 2, 3)}, str(plan)   # over the data and context axes at once


def _checkpointed_context(rank, mode: str):
    """cp2 ring beside activation checkpointing: block 0's MLP recomputed in backward (a
    module whose forward is local), or every micro-batch's stage forward (graph-wide)."""
    graph = _stack_graph("ring", P01)
    if mode == "mlp":
        graph.model.blocks[0].mlp.config.set_activation_checkpointing(True)
    else:
        graph.config.set_activation_checkpointing(mode)
    losses, state = graphc_train(graph, _batches(), feed=feed_split(P01, rank, sbp.split(1)))
    return losses, state, graph.plan


@pytest.mark.slow   # CI time: cp2 alone in test_ring_cp2_matches_eager
@pytest.mark.parametrize("mode", ["mlp", "always"])
def test_activation_checkpointing_beside_the_ring_matches_eager(mode):
    results = LocalWorld(2).run(lambda rank: _checkpointed_context(rank, mode))
    ref_losses, ref_state = _eager(_batches())
    for rank, (losses, state, plan) in enumerate(results):
        assert_same_as_eager(losses, state, ref_losses, ref_state, f"checkpointed {mode} cp2 rank {rank}")
        assert len(_exchanges(plan, "F")) == 2, str(plan)   # both layers' ring steps listed


def test_checkpointing_a_module_with_ring_attention_is_refused():
    """Recomputing the ring would run its exchanges again, unlisted by the plan: refused."""
    graph = _stack_graph("ring", P01)
    graph.model.blocks[0].config.set_activation_checkpointing(True)
    x, y = _batches()[0]
    with pytest.raises(graphc.GraphcError, match="blocks.0.*communicates.*scaled_dot_product_attention"):
        compile_graph(graph, [global_input(x, P01, sbp.split(1)), global_input(y, P01, sbp.split(1))], 2)


def _pipeline_x_context(rank, load_balance: bool = False):
    """Block 0 (and the input Linear) on ranks 0-1, block 1 and the head on ranks 2-3, the
    sequence split over each stage's two ranks (dealt zig-zag on both with load_balance: the
    activations cross between stages dealt so, the labels redealt where they enter stage 1),
    two micro-batches."""
    p0, p1 = graphc.placement("cpu", [0, 1]), graphc.placement("cpu", [2, 3])
    torch.manual_seed(0)
    model = BlockStack(layers=2, block=16)
    graph = TokenLossGraph(model, OPTIMIZERS["sgd_momentum"](model.parameters()))
    for name, stage, where in (("inp", 0, p0), ("ln_f", 1, p1), ("head", 1, p1)):
        getattr(graph.model, name).config.set_stage(stage, where)
    graph.model.blocks[0].config.set_stage(0, p0)
    graph.model.blocks[1].config.set_stage(1, p1)
    graph.config.set_gradient_accumulation_steps(2)
    graph.config.set_context_parallel(method="ring", load_balance=load_balance)
    def feed(x, y):   # a rank outside an input's placement passes any component of its shape
        return tuple(global_input(t, p, sbp.split(1), rank if rank in p.flat_ranks else None)
                     for t, p in ((x, p0), (y, p1)))
    losses, state = graphc_train(graph, _batches(batch=4), feed=feed)
    return losses, state, graph.plan


@pytest.mark.slow   # CI time: cp2 alone in test_ring_cp2_matches_eager
@pytest.mark.parametrize("load_balance", [False, True])
def test_pipeline_x_context_matches_eager(load_balance):
    results = LocalWorld(4).run(lambda rank: _pipeline_x_context(rank, load_balance))
    ref_losses, ref_state = _eager(_batches(batch=4))
    for rank, (losses, state, plan) in enumerate(results):
        assert_same_as_eager(losses if rank >= 2 else ref_losses, state, ref_losses, ref_state, f"pp2 x cp2 rank {rank}")
        ring = [i for i in plan.instructions if isinstance(i, Collective) and i.kind == "send_recv"]
        assert len(ring) == 2 * (1 + 2), [str(i) for i in ring]   # one attention a stage, 2 micro-batches


# -- gloo -------------------------------------------------------------------------------------
def _gloo_train(rank, world):
    graph = _stack_graph("ring", P01)
    return graphc_train(graph, _batches(t=7), feed=feed_split(P01, rank, sbp.split(1)))


@pytest.mark.world
@pytest.mark.slow   # CI time: the local world's cp2 in test_ring_cp2_matches_eager
def test_ring_on_gloo_matches_eager():
    """Two processes on gloo: the ring's transfers through torch.distributed's isend/irecv,
    an uneven sequence (7 positions: shards of 4 and 3)."""
    results = run_world(_gloo_train, 2)
    ref_losses, ref_state = _eager(_batches(t=7))
    for rank, (losses, state) in enumerate(results):
        assert_same_as_eager(losses, state, ref_losses, ref_state, f"gloo cp2 rank {rank}")


# -- activation memory ------------------------------------------------------------------------
@pytest.mark.slow   # ~20 s: two Llama steps at 1024 tokens (benchmarks/context_parallel_memory.py)
def test_cp4_keeps_under_a_third_of_the_unsplit_activations():
    """Saved activation bytes per rank on cp4 ring against one rank with the whole sequence:
    every activation but the mask's key columns is a quarter (measured 0.20x at 1024 tokens,
    0.16x at 4096; the issue's target is 0.3x)."""
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import context_parallel_memory as bench
    args = type("Args", (), dict(seq=1024, method="ring", layers=2, heads=4, embd=64, vocab=64))
    whole = bench.saved_bytes(1, args)[0]
    split = bench.saved_bytes(4, args)
    assert max(split) <= 0.3 * whole, (split, whole)
