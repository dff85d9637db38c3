"""Compute orders of pipeline schedules: per pipeline rank, its chunks' compute in order.

A schedule's order is a pure function `(rank, num_ranks, num_stages, num_microbatches)` ->
the instructions pipeline rank `rank` (0..p-1) computes, in order, naming global stage ids
(Forward `sFm`, Backward `sBm`, split backward `sIm` / `sWm`, DualPipeV's OverlapFB), on
the stages its layout family gives the rank (plan/schedule_layouts.py). `peak_live` walks
an order for the activations it keeps; docs/schedules.md compares them. The records that
name these functions, their checks and the queries over them are plan/schedules.py's
(See NOTE: Schedule registry).
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Callable, Deque, List, Optional, Sequence, Tuple

from .instructions import (Backward, BackwardInput, BackwardWeight, Forward, Instruction,
                           OverlapFB)
from .schedule_layouts import INTERLEAVED_LAYOUT, V_LAYOUT

# (rank, num_ranks, num_stages, num_microbatches) -> that pipeline rank's compute, in order
ComputeOrder = Callable[[int, int, int, int], List[Instruction]]


def gpipe(rank: int, num_ranks: int, num_stages: int, num_microbatches: int) -> List[Instruction]:
    """All forwards, then all backwards: every stage holds m micro-batches of activations."""
    m = num_microbatches
    return [Forward(rank, i) for i in range(m)] + [Backward(rank, i) for i in range(m)]


def one_f_one_b(rank: int, num_ranks: int, num_stages: int, num_microbatches: int) -> List[Instruction]:
    """1F1B: min(p - s, m) warm-up forwards, then one backward / one forward, then drain.

    Stage s therefore never holds more than min(p - s, m) micro-batches of activations.
    """
    m, stage = num_microbatches, rank
    warmup = min(num_stages - stage, m)
    order: List[Instruction] = [Forward(stage, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Backward(stage, i), Forward(stage, warmup + i)]
    order += [Backward(stage, i) for i in range(m - warmup, m)]
    return order


# NOTE: schedules with several chunks per rank
# A rank holding v stages ("chunks") counts live activations in chunk-micro-batches: one
# chunk's activations for one micro-batch, about 1/v of a one-stage-per-rank stage's. The
# orders below are torch.distributed.pipelining's (tests compare them action for action);
# torch pads them with idle slots, which a plan does not need (receives wait instead).


def interleaved_1f1b(rank: int, num_ranks: int, num_stages: int,
                     num_microbatches: int) -> List[Instruction]:
    """Interleaved 1F1B (Megatron-LM's, as torch's ScheduleInterleaved1F1B): depth first.

    Rank r holds chunks r, r+p, ... (v of them). Micro-batches go in rounds of
    k = m // max(1, m // p) (k = p when p divides m): a round's k forwards run through the
    rank's first chunk, then the same k through its second, and so on; backwards likewise,
    last chunk first. The rank warms up with (v-1)k + 2(p-1-r) forwards (all v*m if fewer),
    then alternates one forward and one backward, then drains the backwards.

    Peak live: warm-up + 1 chunk-micro-batches, (v-1)k + 2(p-r) - 1 (at most v*m); see
    NOTE: schedules with several chunks per rank. With v = 1 that is 2(p-r) - 1, almost
    twice 1f1b's p-r: torch warms up two forwards per hop for every v.
    """
    p, m = num_ranks, num_microbatches
    chunks = INTERLEAVED_LAYOUT.layout(p, num_stages)[rank]
    k = _round_size(p, m)
    warmup = min((len(chunks) - 1) * k + 2 * (p - 1 - rank), len(chunks) * m)
    forwards = [Forward(s, i) for s, i in _depth_first(chunks, m, k)]
    backwards = [Backward(s, i) for s, i in _depth_first(chunks[::-1], m, k)]
    return _one_forward_one_backward(forwards, backwards, warmup)


def looped_bfs(rank: int, num_ranks: int, num_stages: int,
               num_microbatches: int) -> List[Instruction]:
    """Looped breadth first (arXiv 2211.05953, torch's ScheduleLoopedBFS): GPipe per chunk.

    Rank r runs all m forwards of its first chunk, then all of its next chunk, ...; then
    the backwards, last chunk first, each chunk's micro-batches from m-1 down to 0 (the
    last forward is the first whose gradient comes back).

    Peak live: every forward before any backward, v*m chunk-micro-batches.
    """
    chunks = INTERLEAVED_LAYOUT.layout(num_ranks, num_stages)[rank]
    m = num_microbatches
    return ([Forward(s, i) for s in chunks for i in range(m)]
            + [Backward(s, i) for s in reversed(chunks) for i in reversed(range(m))])


def zero_bubble(rank: int, num_ranks: int, num_stages: int,
                num_microbatches: int) -> List[Instruction]:
    """Interleaved zero bubble ZB1P (arXiv 2401.10241, torch's ScheduleInterleavedZeroBubble).

    Interleaved 1F1B with split backwards and a shorter warm-up, (v-1)k + (p-1-r) forwards
    (rounds of k as in interleaved_1f1b): each backward is an input gradient `I`, sent
    upstream at once, and rank r holds back its weight gradients `W` by r input gradients,
    running W of one micro-batch right after the I that comes r later (the rest at the end).
    The upstream ranks get their gradients sooner, and the deferred Ws fill the bubbles.

    Peak live (a micro-batch lives until its W): warm-up + 1 + r, (v-1)k + p on every rank
    when m is large enough; see NOTE: schedules with several chunks per rank.
    """
    p, m = num_ranks, num_microbatches
    chunks = INTERLEAVED_LAYOUT.layout(p, num_stages)[rank]
    k = _round_size(p, m)
    warmup = min((len(chunks) - 1) * k + (p - 1 - rank), len(chunks) * m)
    forwards = [Forward(s, i) for s, i in _depth_first(chunks, m, k)]
    inputs = [BackwardInput(s, i) for s, i in _depth_first(chunks[::-1], m, k)]
    return _defer_weights(_one_forward_one_backward(forwards, inputs, warmup), lag=rank)


def zbv(rank: int, num_ranks: int, num_stages: int, num_microbatches: int) -> List[Instruction]:
    """ZB-V (arXiv 2401.10241 section 6, torch's ScheduleZBVZeroBubble): zero bubble on a V.

    Rank r holds chunk c0 = stage r (going down the V) and c1 = stage 2p-1-r (coming back
    up); the last stage sits on rank 0. Every backward is split into I and W. Phases:
      warm-up:  2(p-r)-1 forwards of c0; r pairs (F c1, F c0); p-r triples (F c1, I c1, W c1)
      steady:   (F c0, I c0, W c0, F c1, I c1, W c1) until c1 has had every forward
                (F c0 is left out once c0 has had them all)
      cool-down: r pairs (I c0, I c1); p-r pairs (I c0, W c0); the held Ws, c1's then c0's.
    The order is built for max(m, 2p-1) micro-batches and the micro-batches from m on are
    dropped, so any m works (with fewer than 2p-1 the pipeline is never full).

    Peak live (a micro-batch lives until its W): 2p chunk-micro-batches on every rank once
    m >= 2p-1 (with fewer, min(2m, m + r + 1) on rank r), about what rank 0 of 1f1b holds
    for the same model (a chunk is half a stage); see NOTE: schedules with several chunks
    per rank.
    """
    p, m = num_ranks, num_microbatches
    n = max(m, 2 * p - 1)
    c0, c1 = V_LAYOUT.layout(p, num_stages)[rank]
    it = _Issuer()
    for _ in range(2 * (p - rank) - 1):
        it.forward(c0)
    for _ in range(rank):
        it.forward(c1)
        it.forward(c0)
    for _ in range(p - rank):
        it.forward(c1)
        it.backward(c1, split=True)
        it.weight(c1)
    while it.issued(Forward, c1) < n:
        if it.issued(Forward, c0) < n:
            it.forward(c0)
        it.backward(c0, split=True)
        it.weight(c0)
        it.forward(c1)
        it.backward(c1, split=True)
        it.weight(c1)
    for _ in range(rank):
        it.backward(c0, split=True)
        it.backward(c1, split=True)
    for _ in range(p - rank):
        it.backward(c0, split=True)
        it.weight(c0)
    it.all_weights(c1)
    it.all_weights(c0)
    return [ins for ins in it.order if ins.microbatch < m]


def dualpipev(rank: int, num_ranks: int, num_stages: int,
              num_microbatches: int) -> List[Instruction]:
    """DualPipeV (DeepSeek-V3's DualPipe folded on a V, torch's ScheduleDualPipeV).

    Rank r holds c0 = stage r and c1 = stage 2p-1-r, as in zbv. The steady state pairs a
    forward of one chunk with the whole backward of the other in one OverlapFB, so that on
    an accelerator one's compute hides the other's communication. Phases:
      1. 2(p-r-1) forwards of c0
      2. r+1 pairs (F c0, F c1)
      3. p-r-1 times: I c1, its W, F c1
      4. m-2p+r+1 times: (F c0; B c1), (F c1; B c0) overlapped (on the last rank the first
         F c0 and B c1 run apart, as torch runs them, to shorten the bubble)
      5. p-r-1 times: B c1, (F c1; B c0)
      6. r+1 pairs of backwards (c1, c0): the first r+1 whole, the rest split (I, W held)
      7. p-r-1 times: the oldest held W, I c0
      8. the r+1 Ws still held, oldest first.
    Needs m >= 2p (phase 4 runs at least once on every rank).

    Peak live (a micro-batch lives until its B or W): 2p + 1 chunk-micro-batches on every
    rank, counting an OverlapFB's forward before its backward; see NOTE: schedules with
    several chunks per rank.
    """
    p, r, m = num_ranks, rank, num_microbatches
    c0, c1 = V_LAYOUT.layout(p, num_stages)[rank]
    it = _Issuer()
    for _ in range(2 * (p - r - 1)):
        it.forward(c0)
    for _ in range(r + 1):
        it.forward(c0)
        it.forward(c1)
    for _ in range(p - r - 1):
        it.backward(c1, split=True)
        it.weight()
        it.forward(c1)
    for i in range(m - 2 * p + r + 1):
        if i == 0 and r == p - 1:
            it.forward(c0)
            it.backward(c1)
        else:
            it.overlap(c0, c1)
        it.overlap(c1, c0)
    for _ in range(p - r - 1):
        it.backward(c1)
        it.overlap(c1, c0)
    for i in range(2 * (r + 1)):
        it.backward(c1 if i % 2 == 0 else c0, split=i >= r + 1)
    for _ in range(p - r - 1):
        it.weight()
        it.backward(c0, split=True)
    it.all_weights()
    return it.order


def _round_size(num_ranks: int, num_microbatches: int) -> int:
    """Micro-batches per round of the interleaved schedules: m split into max(1, m // p)
    equal rounds (check_schedule makes sure it divides)."""
    return num_microbatches // max(1, num_microbatches // num_ranks)


def _depth_first(chunks: Sequence[int], num_microbatches: int, k: int) -> List[Tuple[int, int]]:
    """(stage, micro-batch) pairs: each round of k micro-batches through every chunk in turn."""
    return [(s, i) for start in range(0, num_microbatches, k) for s in chunks
            for i in range(start, start + k)]


def _one_forward_one_backward(forwards: List[Instruction], backwards: List[Instruction],
                              warmup: int) -> List[Instruction]:
    """`warmup` forwards, then one forward and one backward in turn, then the last backwards."""
    order = list(forwards[:warmup])
    for f, b in zip(forwards[warmup:], backwards):
        order += [f, b]
    return order + list(backwards[len(forwards) - warmup:])


def _defer_weights(order: List[Instruction], lag: int) -> List[Instruction]:
    """Adds each BackwardInput's BackwardWeight after the `lag`-th later BackwardInput (the
    last `lag` of them at the end), oldest first."""
    out: List[Instruction] = []
    held: Deque[BackwardWeight] = deque()
    for ins in order:
        out.append(ins)
        if ins.runs == BackwardInput.runs:
            held.append(BackwardWeight(ins.stage, ins.microbatch))
            if len(held) > lag:
                out.append(held.popleft())
    return out + list(held)


class _Issuer:
    """Builds one rank's order for the V schedules, numbering as it goes: a stage's k-th
    forward is micro-batch k, and so is its k-th backward, whole (B) or split (I). A split
    backward's W is held until `weight` asks for it."""

    def __init__(self) -> None:
        self.order: List[Instruction] = []
        self._count: Counter = Counter()
        self._held: Deque[BackwardWeight] = deque()

    def issued(self, kind: type, stage: int) -> int:
        """How many forwards (kind Forward) or backwards (any other) `stage` has had."""
        return self._count[kind is Forward, stage]

    def _next(self, kind: type, stage: int) -> Instruction:
        key = (kind is Forward, stage)
        self._count[key] += 1
        return kind(stage, self._count[key] - 1)

    def forward(self, stage: int) -> None:
        self.order.append(self._next(Forward, stage))

    def backward(self, stage: int, split: bool = False) -> None:
        ins = self._next(BackwardInput if split else Backward, stage)
        if split:
            self._held.append(BackwardWeight(stage, ins.microbatch))
        self.order.append(ins)

    def overlap(self, forward_stage: int, backward_stage: int) -> None:
        self.order.append(OverlapFB(self._next(Forward, forward_stage),
                                    self._next(Backward, backward_stage)))

    def weight(self, stage: Optional[int] = None) -> None:
        """The oldest held W (of `stage`, if given); nothing if none is held."""
        for w in self._held:
            if stage is None or w.stage == stage:
                self._held.remove(w)
                self.order.append(w)
                return

    def all_weights(self, stage: Optional[int] = None) -> None:
        while any(stage is None or w.stage == stage for w in self._held):
            self.weight(stage)


def peak_live(order: Sequence[Instruction]) -> int:
    """The most micro-batches whose activations a rank holds at once under `order`.

    Counts (stage, micro-batch) pairs, so on a rank with several chunks the unit is a
    chunk-micro-batch (see NOTE: schedules with several chunks per rank). A pair is live
    from its forward until its backward is done: its B, or its W for a split backward,
    since W still reads the stage's saved inputs and activations that I left (I frees only
    what the input gradient alone needed, so this is an upper bound). An OverlapFB counts
    its forward before its backward, as they run on a CPU.

    Example:
        peak_live(one_f_one_b(0, 4, 4, 8))   # 4: stage 0 of 1f1b holds min(p - s, m)
    """
    live = peak = 0
    for ins in order:
        for part in ins.parts:
            live += _HOLDS.get(part.runs, 0)
            peak = max(peak, live)
    return peak


# what a compute does to the micro-batches a rank holds, by its run entry: a forward starts
# holding one, its backward (whole, or the weight half) ends that
_HOLDS = {Forward.runs: 1, Backward.runs: -1, BackwardWeight.runs: -1}
