"""Context parallelism: attention over a sequence split across the ranks of a mesh axis.

NOTE: Context parallel
With `config.set_context_parallel(method=...)` and inputs split along the sequence
(`split(1)` of [B, T, ...] over an axis of their placement), every op of a transformer but
attention runs on its shard of positions without communication: embeddings, norms, MLPs and
RoPE (its cos/sin from positions split alike) are per position, and the token-mean loss over
a split sequence divides the local sum by the whole count (localize_ops). Attention is the
one op where a position reads every other, so scaled_dot_product_attention gets a signature
of its own (`sequence_signature`): q, k and v split on their sequence dim (-2 of
[B, H, L, E]), an explicit mask's query rows split with the queries (its key columns whole:
a ring step reads the columns of the keys it holds), the output split like q. No rank ever
holds the whole sequence's keys and values at once. localize_ops turns the call into
`graphc.ops.context_parallel.context_parallel_attention`, one of two methods:

    ring        each rank keeps its queries; keys and values go around the ring of the axis
                (n-1 exchanges, each rank sending its block to the next and receiving the
                previous one's), each block's scores merged into the output with an online
                log-sum-exp softmax; backward is a ring too (n-1 exchanges of k, v and
                their partial gradients, and one more that hands the gradients home).
                Causal blocks wholly above the diagonal are skipped (no scores computed).
                Each step's transfer is posted before its block is computed, and runs
                beside it (dk, dv, which the block adds to, follow once added).
    all_to_all  Ulysses: one all_to_all each for q, k and v trades sequence shards for head
                shards, attention runs on whole sequences of H/n heads, and one all_to_all
                trades the output back (the same four backward). Needs heads (and key/value
                heads) divisible by n, and a mask that is whole on the rank.

Past attention the sequence stays split to the loss: where a value leaves through an op that
cannot keep the split (HF's logits viewed as [B*T, V]), infer_sbp re-splits it by rows with
an all-to-all (`no_partial_from_split(split_only=True)`), never gathering it whole.

The plan lists each exchange as a Collective of the attention node (list_collectives reads
`exchanges`): a ring step as `send_recv` over the ring's ranks, with the bytes a rank sends;
the verifier pairs them as it pairs every collective of a group (every member lists the same
steps in the same order), so a ring whose ranks disagree on its steps is refused before it
runs. Numbers equal eager attention on the whole sequence (float64, 1e-10: the merge is exact
up to rounding).

Load balance (`load_balance=True`, See NOTE: Zig-zag dealing in graphc/sbp/layout.py): with
contiguous shards a causal rank k attends to k+1 of the n blocks, so rank n-1 does n times
rank 0's work. deal_zigzag deals the sequence zig-zag between the inputs and the outputs
(rank k holds chunks k and 2n-1-k of 2n), the boxes reorder the sequence where it is gathered
or dealt, and the ring computes by (query run, key run) pairs of true positions: a pair wholly
above the diagonal, or hidden whole by an explicit mask (HF's causal-and-padding mask), is
skipped, so each rank computes 2n+1 chunk pairs. Ulysses puts the sequence in order as its
all-to-all makes it whole, and deals it again on the way back.

Not done: attention dropout on a split sequence is not offered (such a call keeps its other
signatures).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch.fx as fx
import torch.nn.functional as F

from ..errors import GraphcError
from ..meta import META_CONTEXT_PARALLEL, META_SBP, META_TENSOR
from .cost import tensor_bytes
from .layout import B, S, local_shape

METHODS = ("ring", "all_to_all")


@dataclass(frozen=True)
class ContextParallel:
    """config.set_context_parallel's choice (See NOTE: Context parallel)."""

    method: str = "ring"
    load_balance: bool = False


def checked(method, load_balance) -> ContextParallel:
    """The option as set_context_parallel takes it, or a GraphcError saying what to pass."""
    if method not in METHODS:
        raise GraphcError(f"set_context_parallel: method must be one of {list(METHODS)}, found "
                          f"{method!r}. Fix: method=\"ring\" or method=\"all_to_all\".")
    if not isinstance(load_balance, bool):
        raise GraphcError(f"set_context_parallel: load_balance expects True or False, found {load_balance!r}")
    return ContextParallel(method, load_balance)


def mark_attention(gm: fx.GraphModule, cp: Optional[ContextParallel]) -> None:
    """Stamps the context-parallel choice on every scaled_dot_product_attention call, so that
    its SBP rule offers the sequence split (nothing is stamped without the option)."""
    if cp is None:
        return
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is F.scaled_dot_product_attention:
            node.meta[META_CONTEXT_PARALLEL] = cp


def sequence_signature(ctx) -> List[tuple]:
    """The sequence-split signature of a stamped attention call (See NOTE: Context parallel):
    q, k, v S(-2), the mask's query rows S(-2) (ring) or the mask whole (all_to_all)."""
    cp = ctx.node.meta.get(META_CONTEXT_PARALLEL)
    q, k, v = ctx.node.args[0], ctx.arg(1, "key"), ctx.arg(2, "value")
    mask, out = ctx.arg(3, "attn_mask"), ctx.out
    if cp is None or out is None or float(ctx.arg(4, "dropout_p", 0.0) or 0.0) != 0.0:
        return []
    mq, mk, mv = ctx.meta(q), ctx.meta(k), ctx.meta(v)
    if len(mq.shape) < 3 or mq.shape[-2] != mk.shape[-2] or mk.shape != mv.shape or \
            not ctx.splits(mq.shape[-2]):
        return []
    r = len(out.shape)
    req = {q: S(len(mq.shape) - 2), k: S(len(mk.shape) - 2), v: S(len(mv.shape) - 2)}
    if cp.method == "all_to_all" and not all(ctx.divisible(m.shape[-3]) for m in (mq, mk)) or \
            cp.method == "all_to_all" and not ctx.divisible(mq.shape[-2]):
        return []
    mm = ctx.meta(mask)
    if mm is not None:
        if len(mm.shape) < 2 or mm.requires_grad:
            return []
        rows = mm.shape[-2]
        req[mask] = S(len(mm.shape) - 2) if cp.method == "ring" and rows == mq.shape[-2] else B
    return [(req, S(r - 2))]


def exchanges(node: fx.Node, forward: bool, n: int) -> List[Tuple[str, int, str]]:
    """The exchanges one context-parallel attention call makes per micro-batch on an axis of
    n ranks, in order: (collective kind, bytes a rank sends, note), for the plan's listing."""
    cp = node.meta[META_CONTEXT_PARALLEL]
    q, k = (a.meta[META_TENSOR] for a in node.args[:2])
    out, sig = node.meta[META_TENSOR].shape, node.meta[META_SBP]
    held = math.prod(local_shape(out, sig.out, sig.mesh)) / math.prod(out)   # q, k, v split alike
    block = lambda m: int(tensor_bytes(m) * held)  # noqa: E731 - this rank's shard of a value
    if cp.method == "all_to_all":
        moved = [block(q), block(k), block(k), block(q)]   # q, k, v in; the output back
        names = ("q", "k", "v", "out")
        found = [("all_to_all", b * (n - 1) // n, f"ulysses {w}") for b, w in zip(moved, names)]
        return found if forward else found[::-1]   # backward: the output's gradient first
    kv = 2 * block(k)
    grads = kv * (2 if str(k.dtype) in ("bfloat16", "float16") else 1)   # float32 sums: NOTE: Ring precision
    if forward:
        return [("send_recv", kv, f"ring step {s + 1}/{n - 1}: k, v") for s in range(n - 1)]
    steps = [("send_recv", kv + grads, f"ring step {s + 1}/{n - 1}: k, v, dk, dv") for s in range(n - 1)]
    return steps + [("send_recv", grads, "ring home: dk, dv")]


def ring_block_flops(node: fx.Node, n: int) -> float:
    """FLOPs of the forward of one ring step's block on a rank (its queries' scores against
    one block of keys, and their product with the values: 2 matmuls of 2 q_numel Lk each), the
    blocks a causal ring skips averaged over the steps ((n+1)/(2n) of a full block); an explicit
    mask is taken as full (what it hides is data). See NOTE: Ring overlap in
    graphc/tools/ring_overlap.py."""
    q, k = (a.meta[META_TENSOR] for a in node.args[:2])
    out, sig = node.meta[META_TENSOR].shape, node.meta[META_SBP]
    held = math.prod(local_shape(out, sig.out, sig.mesh)) / math.prod(out)   # q, k, v split alike
    flops = 4 * math.prod(q.shape) * held * k.shape[-2] / n
    return flops * (n + 1) / (2 * n) if node.kwargs.get("is_causal") else flops


