"""Attention over a sequence split across a mesh axis (See NOTE: Context parallel, in
graphc/sbp/context_parallel.py): the function localize_ops puts in place of a
scaled_dot_product_attention call whose q, k and v are split along the sequence.

Each rank holds [B, H, Lk, E] queries, keys and values of its shard k of the sequence
(torch.chunk's: rank k of n holds positions chunk_range(T, n, k)), and an explicit mask's
rows of those queries with every key column ([..., Lk, T]).

ring: forward keeps q and passes (k, v) around the ring; at step s the rank holds the block of
rank (k - s) mod n and merges its softmax block into the output by log-sum-exp:

    lse = logaddexp(lse_a, lse_b),  out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)

Backward (the flash-attention gradient per block, with the forward's final lse and
D = rowsum(dO * O)) passes (k, v, dk, dv) around the ring: each rank adds its queries' part
of the block's dk, dv to the partial sums that travel with the block, and after n steps one
more exchange hands each block's dk, dv to its owner.

Overlap: a step posts the next block's transfer (k, v) before computing on the block it holds
and waits for it after; in backward dk, dv follow once this rank has added to them. The
numbers are the same (the same blocks merged in the same order); only the waiting moves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .. import world
from ..sbp.layout import chunk_range, zigzag_pieces
from .conversions import box, counting_shapes, my_group

RING_TAG = 0x7C0000   # apart from the pipeline's transfer tags (one queue per peer and tag)


def context_parallel_attention(q, k, v, attn_mask, groups: tuple, method: str, seq_len: int,
                               is_causal: bool = False, scale: Optional[float] = None,
                               enable_gqa: bool = False, load_balance: bool = False) -> torch.Tensor:
    """This rank's output rows of scaled_dot_product_attention(q, k, v, attn_mask, is_causal,
    scale) on the whole sequence of `seq_len` positions, split over this rank's group among
    `groups` (See NOTE: Context parallel); load_balance: the sequence dealt zig-zag (See
    NOTE: Zig-zag dealing)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if method == "all_to_all":
        return _ulysses(q, k, v, attn_mask, groups, is_causal, scale, enable_gqa, load_balance)
    return _RingAttention.apply(q, k, v, attn_mask, _Ring(groups, seq_len, load_balance), is_causal, scale)


# -- all_to_all (Ulysses) ---------------------------------------------------------------
def _ulysses(q, k, v, attn_mask, groups, is_causal, scale, enable_gqa, load_balance):
    """Sequence shards traded for head shards (dim -2 -> dim -3), whole-sequence attention on
    this rank's heads, and the output traded back; each trade's backward is the reverse. A
    zig-zag sequence is put back in order as it becomes whole, and dealt again on the way out."""
    seq, heads = q.dim() - 2, q.dim() - 3
    q, k, v = (box(t, "all_to_all", groups, t.dim() - 2, t.dim() - 3, zigzag=(load_balance, False))
               for t in (q, k, v))
    if attn_mask is not None and attn_mask.dim() >= 3 and attn_mask.shape[-3] > 1:
        attn_mask = _my_heads(attn_mask, groups)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return box(out, "all_to_all", groups, heads, seq, zigzag=(False, load_balance))


def _my_heads(mask, groups):
    _, me, n = my_group(groups)
    start, size = chunk_range(mask.shape[-3], n, me)
    return mask.narrow(-3, start, size)


# -- ring -------------------------------------------------------------------------------
class _Ring:
    """This rank's place on the ring of its group: who it sends to and receives from, and
    which positions each rank's block holds (contiguous, or dealt zig-zag)."""

    def __init__(self, groups: tuple, seq_len: int, load_balance: bool = False):
        self.group, self.me, self.n = my_group(groups)
        self.next, self.prev = self.group[(self.me + 1) % self.n], self.group[(self.me - 1) % self.n]
        self.seq_len, self.load_balance = seq_len, load_balance

    def owner(self, step: int) -> int:
        """Whose block this rank holds at ring step `step` (0: its own)."""
        return (self.me - step) % self.n

    def pieces(self, index: int) -> Tuple[Tuple[int, int], ...]:
        """(global start, length) of each run of positions in rank `index`'s block, in order."""
        if self.load_balance:
            return zigzag_pieces(self.seq_len, self.n, index)
        return (chunk_range(self.seq_len, self.n, index),)

    def pairs(self, block: int, is_causal: bool, masked: bool) -> List["_Pair"]:
        """The (query run, key run) pairs of this rank's queries against `block`'s keys, each
        run of positions apart where a mask reads positions (`masked`: an explicit mask),
        less those the causal mask hides whole; without masks, the whole block as one pair."""
        mine, theirs = self.pieces(self.me), self.pieces(block)
        if not is_causal and not masked:
            return [_Pair(0, sum(n for _, n in mine), mine[0][0], 0, sum(n for _, n in theirs),
                          theirs[0][0], False)]
        found, q_local = [], 0
        for q_start, q_len in mine:
            k_local = 0
            for k_start, k_len in theirs:
                seen = not is_causal or k_start <= q_start + q_len - 1   # a key at or before a query
                if q_len and k_len and seen:
                    found.append(_Pair(q_local, q_len, q_start, k_local, k_len, k_start,
                                       is_causal and k_start + k_len - 1 > q_start))
                k_local += k_len
            q_local += q_len
        return found

    def pass_on(self, tensors: Sequence[torch.Tensor], from_block: int) -> List[torch.Tensor]:
        """Sends `tensors` to the next rank and receives the previous rank's, which hold
        sequence block `from_block` (its length sizes the buffers)."""
        return self.start(tensors, from_block).wait()

    def start(self, tensors: Sequence[torch.Tensor], from_block: int) -> "_InFlight":
        """pass_on posted without waiting: the transfer runs while this rank computes on
        what it holds (a step's block), finished by the returned handle's wait(). Transfers
        between two ranks are matched in the order they were started."""
        size = sum(n for _, n in self.pieces(from_block))
        shapes = [_with_rows(t.shape, size) for t in tensors]
        if counting_shapes():
            return _InFlight([t.new_zeros(s) for t, s in zip(tensors, shapes)], [])
        me = world.current()
        got = [t.new_empty(s) for t, s in zip(tensors, shapes)]
        waits = [me.irecv(g, self.prev, RING_TAG, ranks=self.group) for g in got]
        sends = [me.isend(t.contiguous(), self.next, RING_TAG, ranks=self.group) for t in tensors]
        return _InFlight(got, waits + sends)


class _InFlight:
    """A ring transfer posted: its receive buffers, filled once wait() returns."""

    def __init__(self, got: List[torch.Tensor], pending: list):
        self.got, self.pending = got, pending

    def wait(self) -> List[torch.Tensor]:
        for w in self.pending:
            w.wait()
        return self.got


@dataclass(frozen=True)
class _Pair:
    """Queries rows [q_local, +q_len) of this rank (global positions from q_start) against key
    rows [k_local, +k_len) of a block (from k_start); `diagonal`: some key comes after some
    query, so the causal mask is applied inside."""

    q_local: int
    q_len: int
    q_start: int
    k_local: int
    k_len: int
    k_start: int
    diagonal: bool

    def queries(self, t):
        return t.narrow(-2, self.q_local, self.q_len)

    def keys(self, t):
        return t.narrow(-2, self.k_local, self.k_len)


def _with_rows(shape, rows: int) -> list:
    shape = list(shape)
    shape[-2] = rows
    return shape


def pair_scores(q, kb, mask, pair: _Pair, scale: float):
    """Scores of one (query run, key run) pair, masked: the explicit mask's rows of those
    queries (when it has a row per query) and columns of those keys, and the causal mask by
    global position where the pair straddles the diagonal. None where the explicit mask hides
    the whole pair (nothing to add to the softmax: skipped, so an explicit causal mask is
    balanced as is_causal is)."""
    block = None if mask is None else _mask_block(mask, pair, q.shape[-2])
    if block is not None and _hides_all(block):
        return None
    s = torch.matmul(pair.queries(q), _repeat_heads(pair.keys(kb), q.shape[-3]).transpose(-2, -1)) * scale
    if block is not None:
        s = s.masked_fill(~block, float("-inf")) if block.dtype == torch.bool else s + block
    if pair.diagonal:
        qi = torch.arange(pair.q_start, pair.q_start + pair.q_len, device=s.device).unsqueeze(-1)
        ki = torch.arange(pair.k_start, pair.k_start + pair.k_len, device=s.device).unsqueeze(0)
        s = s.masked_fill(ki > qi, float("-inf"))
    return s


def _mask_block(mask, pair: _Pair, rows: int):
    """The explicit mask's entries of one pair: its rows of the pair's queries (a mask with a
    row per query; one row is broadcast) and its columns of the pair's keys (global positions)."""
    if mask.shape[-2] == rows and rows > 1:
        mask = pair.queries(mask)
    return mask if mask.shape[-1] == 1 else mask.narrow(-1, pair.k_start, pair.k_len)


def _hides_all(block) -> bool:
    """Does the mask block hide every key from every query? (A host sync; exact to skip.)
    Within shapes_only (the simulator counting FLOPs on fake tensors, or timing a stage on
    zeros) the mask is no data: every block is computed (See NOTE: Ring overlap in
    graphc/tools/ring_overlap.py: an explicit mask is taken as full)."""
    if counting_shapes():
        return False
    return not bool(block.any()) if block.dtype == torch.bool else bool(torch.isneginf(block).all())


def _repeat_heads(t, heads: int):
    """Grouped-query keys/values [.., Hk, S, E] repeated to the queries' heads."""
    return t if t.shape[-3] == heads else t.repeat_interleave(heads // t.shape[-3], dim=-3)


def _fold_heads(g, heads: int):
    """The gradient of _repeat_heads: the repeated heads' gradients summed per key head."""
    if g.shape[-3] == heads:
        return g
    shape = list(g.shape)
    shape[-3:-2] = [heads, g.shape[-3] // heads]
    return g.reshape(shape).sum(-3)


def _exp_less(x, lse):
    """exp(x - lse), zero (not NaN) where lse is -inf: a row that sees no key."""
    seen = torch.isfinite(lse)
    return torch.where(seen, torch.exp(x - torch.where(seen, lse, 0)), 0)


def _probabilities(s, lse):
    """The block's softmax probabilities under the whole row's log-sum-exp."""
    return _exp_less(s, lse.unsqueeze(-1))


def merge(out, lse, block_out, block_lse):
    """The softmax over the union of two key sets, from each one's output and log-sum-exp."""
    new = torch.logaddexp(lse, block_lse)
    return out * _exp_less(lse, new).unsqueeze(-1) + block_out * _exp_less(block_lse, new).unsqueeze(-1), new


def _ring_forward(q, k, v, mask, ring: _Ring, is_causal: bool, scale: float):
    """(output, lse) of this rank's queries over the whole ring, in float32 or wider (See
    NOTE: Ring precision); k and v travel in their own dtype."""
    q, mask = _upcast(q), _upcast(mask)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    kb, vb = k, v
    for step in range(ring.n):
        # the next block's transfer runs while this one is computed (an overlap)
        coming = ring.start((kb, vb), ring.owner(step + 1)) if step < ring.n - 1 else None
        kw, vw = _upcast(kb), _upcast(vb)
        for pair in ring.pairs(ring.owner(step), is_causal, mask is not None):
            s = pair_scores(q, kw, mask, pair, scale)
            if s is None:
                continue
            block_lse = torch.logsumexp(s, -1)
            block_out = torch.matmul(_probabilities(s, block_lse), _repeat_heads(pair.keys(vw), q.shape[-3]))
            rows_out, rows_lse = merge(pair.queries(out), lse.narrow(-1, pair.q_local, pair.q_len),
                                       block_out, block_lse)
            pair.queries(out).copy_(rows_out)
            lse.narrow(-1, pair.q_local, pair.q_len).copy_(rows_lse)
        if coming is not None:
            kb, vb = coming.wait()
    return out, lse


def _ring_backward(dout, q, k, v, mask, out, lse, ring: _Ring, is_causal: bool, scale: float):
    """(dq, dk, dv): the block gradients of flash attention, keys' parts travelling with them
    (in float32 or wider, See NOTE: Ring precision)."""
    q, mask, dout = _upcast(q), _upcast(mask), _upcast(dout)
    d = (dout * out).sum(-1, keepdim=True)
    dq = torch.zeros_like(q)
    kb, vb = k, v
    dkb, dvb = torch.zeros_like(k, dtype=q.dtype), torch.zeros_like(v, dtype=q.dtype)
    heads = q.shape[-3]
    for step in range(ring.n):
        # k and v go on while this block is computed; its dk, dv partial sums once added to
        coming = ring.start((kb, vb), ring.owner(step + 1)) if step < ring.n - 1 else None
        kw, vw = _upcast(kb), _upcast(vb)
        for pair in ring.pairs(ring.owner(step), is_causal, mask is not None):
            s = pair_scores(q, kw, mask, pair, scale)
            if s is None:
                continue
            p = _probabilities(s, lse.narrow(-1, pair.q_local, pair.q_len))
            do, qa = pair.queries(dout), pair.queries(q)
            pair.keys(dvb).add_(_fold_heads(torch.matmul(p.transpose(-2, -1), do), kb.shape[-3]))
            ds = p * (torch.matmul(do, _repeat_heads(pair.keys(vw), heads).transpose(-2, -1)) - pair.queries(d))
            pair.queries(dq).add_(torch.matmul(ds, _repeat_heads(pair.keys(kw), heads)) * scale)
            pair.keys(dkb).add_(_fold_heads(torch.matmul(ds.transpose(-2, -1), qa), kb.shape[-3]) * scale)
        if coming is not None:
            grads = ring.start((dkb, dvb), ring.owner(step + 1))
            (kb, vb), (dkb, dvb) = coming.wait(), grads.wait()
    dk, dv = ring.pass_on((dkb, dvb), ring.me) if ring.n > 1 else (dkb, dvb)
    return dq, dk, dv


# NOTE: Ring precision
# Under autocast q, k and v arrive in bfloat16 (or float16). torch's CPU and flash kernels
# keep the scores, the softmax and the products' sums in float32 and round the output (and
# in backward dq, dk, dv) once to the inputs' dtype; the ring does the same: its blocks and
# merges run in float32 (autocast off inside, or it would cast the blocks' matmuls back down)
# and each result is rounded once at the end. It then differs from
# eager's kernel only by float32 summation order (a bf16 rounding flips where the float32
# result lies within ~1e-7 of a rounding boundary), not by a bf16 rounding per block. Keys
# and values travel the ring in their own dtype (exact); the backward's dk, dv partial sums
# travel in float32 (sbp/context_parallel.exchanges lists their bytes so).
def _upcast(t):
    return t.float() if t is not None and t.is_floating_point() and t.element_size() < 4 else t


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, ring, is_causal, scale):
        with torch.autocast(q.device.type, enabled=False):   # float32 inside: See NOTE: Ring precision
            out, lse = _ring_forward(q, k, v, mask, ring, is_causal, scale)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.ring, ctx.is_causal, ctx.scale = ring, is_causal, scale
        return out.to(q.dtype)   # rounded once (See NOTE: Ring precision)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, mask, out, lse, ctx.ring,
                                        ctx.is_causal, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None
