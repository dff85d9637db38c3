"""Compute orders of pipeline schedules: per pipeline rank, its chunks' compute in order.

A schedule is a pure function `(rank, num_ranks, num_stages, num_microbatches)` -> the
instructions pipeline rank `rank` (0..p-1) computes, in order, naming global stage ids
(Forward `sFm`, Backward `sBm`, split backward `sIm` / `sWm`, DualPipeV's OverlapFB).
`layout(schedule, p, num_stages)` says which stages each pipeline rank holds: one stage per
rank for gpipe and 1f1b, stage s on rank s mod p for the interleaved ones (interleaved_1f1b,
looped_bfs, zero_bubble), stages s and 2p-1-s on rank s for the V ones (zbv, dualpipev).
Each schedule is a `Schedule` record in SCHEDULES: its name, its order function, its
LayoutFamily (the layout and the stage count it needs), its own check of the
micro-batches and what describes it, so a new schedule touches this file only (See NOTE:
Schedule registry). `check_schedule` applies the
checks and `peak_live` walks an order for the activations it keeps; docs/schedules.md
compares them.
Communication is added later by lowering (`passes/lower_plan.py`).
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

from ..errors import GraphcError
from .instructions import (Backward, BackwardInput, BackwardWeight, Forward, Instruction,
                           OverlapFB)

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
    chunks = layout("interleaved_1f1b", p, num_stages)[rank]
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
    chunks = layout("looped_bfs", num_ranks, num_stages)[rank]
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
    chunks = layout("zero_bubble", p, num_stages)[rank]
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
    c0, c1 = layout("zbv", p, num_stages)[rank]
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
    c0, c1 = layout("dualpipev", p, num_stages)[rank]
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


def forward_only(rank: int, num_ranks: int, num_stages: int, num_microbatches: int,
                 schedule: str = "interleaved_1f1b") -> List[Instruction]:
    """Inference: each chunk's forwards in micro-batch order, chunks in stage order; the
    chunks are those `schedule`'s layout gives the rank (a V for zbv and dualpipev)."""
    return [Forward(s, i) for s in layout(schedule, num_ranks, num_stages)[rank]
            for i in range(num_microbatches)]


# -- the schedules as records: name, order, layout family, check ------------------------

@dataclass(frozen=True)
class LayoutFamily:
    """How a family of schedules lays n stages on p pipeline ranks, and what that needs."""

    name: str
    layout: Callable[[int, int], List[List[int]]]   # (p, n) -> each rank's stage ids, ascending
    num_stages: Callable[[int], Optional[int]]      # p -> the stages it needs; None: a multiple of p
    check: Callable[[str, int, int], None]          # (where, p, n): refuses a stage count
    needs: Callable[[str, int, int], str]           # (schedule, p, n): the layout, for an error
    holds: str                                      # what rank r holds, for docs/schedules.md


def _one_stage_check(where: str, p: int, n: int) -> None:
    if n != p:
        raise GraphcError(f"{where} runs one stage per rank; found {n} stages. Fix: give each "
                          "stage its own ranks, or choose 'interleaved_1f1b' for several stages "
                          "per rank")


def _one_stage_needs(schedule: str, p: int, n: int) -> str:
    return (f"'{schedule}' runs one stage per rank, so every stage needs its own placement. "
            "Fix: give each stage disjoint ranks, or choose a schedule for several chunks per "
            "rank: config.set_pipeline_schedule('interleaved_1f1b') (stage s on the ranks of "
            "stage s mod p) or 'zbv' / 'dualpipev' (stages s and 2p-1-s on one rank)")


def _interleaved_check(where: str, p: int, n: int) -> None:
    if n % p:
        fits = " or ".join(str(k) for k in sorted({max(p, n // p * p), (n // p + 1) * p}))
        raise GraphcError(f"{where} needs the same number of stages on every rank (a multiple "
                          f"of {p}); found {n} stages. Fix: split the model into {fits} stages")


def _interleaved_needs(schedule: str, p: int, n: int) -> str:
    return (f"'{schedule}' needs stage s on the ranks of stage s mod p, the same number of "
            f"chunks on every rank (for p={p}: " +
            ", ".join(f"{list(range(r, n, p))}" for r in range(p)) + ")")


def _v_check(where: str, p: int, n: int) -> None:
    if n != 2 * p:
        ranks = f", or use {n // 2} pipeline ranks" if n % 2 == 0 and n else ""
        raise GraphcError(f"{where} needs exactly two stages per rank, {2 * p} in all; found "
                          f"{n}. Fix: split the model into {2 * p} stages{ranks}")


def _v_needs(schedule: str, p: int, n: int) -> str:
    return (f"'{schedule}' needs 2p stages in a V: stages s and 2p-1-s on pipeline rank s "
            f"(for p={p}: " + ", ".join(f"{r} and {2 * p - 1 - r}" for r in range(p)) + ")")


def _round_robin(p: int, n: int) -> List[List[int]]:
    return [list(range(r, n, p)) for r in range(p)]


# one stage per rank (gpipe, 1f1b); stage s on rank s mod p (interleaved); s and 2p-1-s (V)
ONE_STAGE_LAYOUT = LayoutFamily("one stage per rank", _round_robin, lambda p: p,
                                _one_stage_check, _one_stage_needs, "stage r")
INTERLEAVED_LAYOUT = LayoutFamily("interleaved", _round_robin, lambda p: None,
                                  _interleaved_check, _interleaved_needs, "stages r, r+p, ...")
V_LAYOUT = LayoutFamily("V", lambda p, n: [sorted((r, 2 * p - 1 - r)) for r in range(p)],
                        lambda p: 2 * p, _v_check, _v_needs, "stages r, 2p-1-r")


def _equal_rounds(where: str, p: int, m: int) -> None:
    if m % max(1, m // p):
        below = next(k for k in range(m, 0, -1) if _rounds_fit(p, k))
        above = next(k for k in range(m, 2 * m + 2 * p) if _rounds_fit(p, k))
        raise GraphcError(f"{where} runs micro-batches in max(1, m // p) rounds of equal size; "
                          f"found {m} micro-batches, which do not split into {m // p} equal "
                          f"rounds. Fix: config.set_gradient_accumulation_steps({below}) or "
                          f"({above}) (a multiple of {p} always works)")


def _microbatch_per_stage(where: str, p: int, m: int) -> None:
    if m < 2 * p:
        raise GraphcError(f"{where} needs at least as many micro-batches as stages, {2 * p}; "
                          f"found {m}. Fix: config.set_gradient_accumulation_steps({2 * p}) or "
                          "more, or choose 'zbv', which takes any number")


def _rounds_fit(num_ranks: int, num_microbatches: int) -> bool:
    return num_microbatches % max(1, num_microbatches // num_ranks) == 0


# NOTE: Schedule registry
# SCHEDULES is the one list of pipeline schedules. Everything that goes over "every
# schedule" reads it when it runs, not a copy: config.set_pipeline_schedule, the compiler,
# the bubble table (tools/bubbles.py), the docs' tables of schedules and of bubbles
# (tools/schedule_table.py, bubbles.markdown, checked against docs/schedules.md), the equivalence sweep (tests/local/sweep.py) and the plan
# tests. So a new schedule is one record here (or one `register_schedule` call in its own
# file), and every check picks it up. What a record cannot compute it states: the torch
# class with the same order (None where torch has none: no test may assume one), the
# preconditions and the peak-live formula as text for the docs, the paper's bubble where
# there is one.


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: its name (config.set_pipeline_schedule), each pipeline rank's
    compute order, the layout family of its stages, and what else it needs of the
    micro-batches (`check(where, p, m)`, after the family's check of the stages).

    The rest describes it (See NOTE: Schedule registry): `torch_class`, the
    torch.distributed.pipelining schedule with the same order (get_schedule_class's name,
    None if torch has none); `needs` and `peak`, the preconditions and rank r's peak live
    chunk-micro-batches as docs/schedules.md prints them; `textbook`, the bubble over the
    ideal step the literature gives, (p, v, m) -> fraction, where it gives one (its
    docstring is the formula the docs print).
    """

    name: str
    order: ComputeOrder
    family: LayoutFamily
    check: Optional[Callable[[str, int, int], None]] = None
    torch_class: Optional[str] = None
    needs: str = ""
    peak: str = ""
    textbook: Optional[Callable[[int, int, int], float]] = None


def _one_chunk_bubble(p: int, v: int, m: int) -> float:
    """(p-1)/m"""
    return (p - 1) / m


def _interleaved_bubble(p: int, v: int, m: int) -> float:
    """(p-1)/(v m)"""
    return (p - 1) / (v * m)


SCHEDULES: Dict[str, Schedule] = {s.name: s for s in (
    Schedule("1f1b", one_f_one_b, ONE_STAGE_LAYOUT, torch_class="1F1B",
             needs="n = p (any m; torch needs m >= p)", peak="min(p - r, m)",
             textbook=_one_chunk_bubble),
    Schedule("dualpipev", dualpipev, V_LAYOUT, _microbatch_per_stage, torch_class="DualPipeV",
             needs="n = 2p, m >= 2p", peak="2p + 1"),
    Schedule("gpipe", gpipe, ONE_STAGE_LAYOUT, torch_class="GPipe", needs="n = p", peak="m",
             textbook=_one_chunk_bubble),
    Schedule("interleaved_1f1b", interleaved_1f1b, INTERLEAVED_LAYOUT, _equal_rounds,
             torch_class="Interleaved1F1B",
             needs="n a multiple of p; m split into max(1, m // p) equal rounds",
             peak="min((v-1)k + 2(p-r) - 1, v m)", textbook=_interleaved_bubble),
    Schedule("looped_bfs", looped_bfs, INTERLEAVED_LAYOUT, torch_class="LoopedBFS",
             needs="n a multiple of p", peak="v m"),
    Schedule("zbv", zbv, V_LAYOUT, torch_class="ZBVZeroBubble", needs="n = 2p (any m)",
             peak="2p once m >= 2p-1"),
    Schedule("zero_bubble", zero_bubble, INTERLEAVED_LAYOUT, _equal_rounds,
             torch_class="InterleavedZeroBubble", needs="as `interleaved_1f1b`",
             peak="min((v-1)k + p, v m)"),
)}

# the schedules of each layout family, by name, as built in (registered ones: `family`)
ONE_STAGE = tuple(s.name for s in SCHEDULES.values() if s.family is ONE_STAGE_LAYOUT)
INTERLEAVED = tuple(s.name for s in SCHEDULES.values() if s.family is INTERLEAVED_LAYOUT)
V_SHAPED = tuple(s.name for s in SCHEDULES.values() if s.family is V_LAYOUT)


def register_schedule(schedule: Schedule) -> Schedule:
    """Adds `schedule` to SCHEDULES (See NOTE: Schedule registry); returns it.

    Example:
        register_schedule(Schedule("my_gpipe", my_order, ONE_STAGE_LAYOUT, needs="n = p"))
    """
    if schedule.name in SCHEDULES:
        raise GraphcError(f"a pipeline schedule named {schedule.name!r} is already registered; "
                          "Fix: give the new one another name")
    SCHEDULES[schedule.name] = schedule
    return schedule


def unregister_schedule(name: str) -> None:
    """Removes a schedule `register_schedule` added (tests register toys and take them out)."""
    del SCHEDULES[name]


def stage_count(schedule: str, num_ranks: int, chunks: int = 2) -> int:
    """The stages a chain needs to run `schedule` on `num_ranks` pipeline ranks: what its
    layout family fixes (p, or 2p for a V), else `chunks` per rank."""
    return SCHEDULES[schedule].family.num_stages(num_ranks) or chunks * num_ranks


def accepts(schedule: str, num_ranks: int, num_stages: int, num_microbatches: int) -> bool:
    """Whether check_schedule lets `schedule` order p ranks, n stages, m micro-batches."""
    try:
        check_schedule(schedule, num_ranks, num_stages, num_microbatches)
    except GraphcError:
        return False
    return True


def layout(schedule: str, num_ranks: int, num_stages: int) -> List[List[int]]:
    """The stage ids each pipeline rank holds under `schedule`, in ascending order."""
    return SCHEDULES[schedule].family.layout(num_ranks, num_stages)


def compute_order(schedule: str, rank: int, num_ranks: int, num_stages: int,
                  num_microbatches: int, training: bool = True) -> List[Instruction]:
    """Pipeline rank `rank`'s compute in order: `schedule`'s in training (checked first by
    check_schedule), each chunk's forwards in stage order in inference."""
    if not training:
        return forward_only(rank, num_ranks, num_stages, num_microbatches, schedule)
    check_schedule(schedule, num_ranks, num_stages, num_microbatches)
    return SCHEDULES[schedule].order(rank, num_ranks, num_stages, num_microbatches)


def check_schedule(schedule: str, num_ranks: int, num_stages: int, num_microbatches: int) -> None:
    """Raises GraphcError unless `schedule` can order p ranks, n stages, m micro-batches.

    The conditions are torch.distributed.pipelining's for the same schedule, except that
    1f1b takes m < p (its warm-up is min(p - s, m); torch's Schedule1F1B needs m >= p):
      gpipe, 1f1b:                 n = p
      interleaved_1f1b, looped_bfs, zero_bubble: n a multiple of p (the same v = n/p chunks
                                   on every rank)
      interleaved_1f1b, zero_bubble: m split into max(1, m // p) rounds of equal size (m a
                                   multiple of p, or m < 2p, or e.g. p=4, m=10: rounds of 5)
      zbv, dualpipev:              n = 2p; dualpipev also m >= 2p
    The layout itself (which rank holds which stage) is checked by pipeline_ranks.

    Example:
        check_schedule("dualpipev", 4, 8, 6)   # GraphcError: needs at least 8 micro-batches
    """
    p, n, m = num_ranks, num_stages, num_microbatches
    if schedule not in SCHEDULES:
        raise GraphcError(f"unknown pipeline schedule {schedule!r}; choose one of "
                          f"{sorted(SCHEDULES)} (see docs/schedules.md)")
    where = f"pipeline schedule '{schedule}' with {p} pipeline ranks"
    SCHEDULES[schedule].family.check(where, p, n)
    if SCHEDULES[schedule].check is not None:
        SCHEDULES[schedule].check(where, p, m)


def pipeline_ranks(stages, schedule: str, training: bool = True) -> List[int]:
    """Each stage's pipeline rank (position 0..p-1), from the placements the user gave.

    Stages on the same ranks form one pipeline rank (it holds several chunks); stages
    whose rank sets overlap without being equal cannot be scheduled. The chunks of each
    pipeline rank must be the ones `layout(schedule, ...)` gives it; otherwise the error
    names the layout the schedule needs.
    """
    groups: List[tuple] = []
    position: List[int] = []
    for s in stages:
        ranks = tuple(s.ranks)
        for g, other in enumerate(groups):
            if other == ranks:
                break
            if set(other) & set(ranks):
                raise GraphcError(
                    f"stage {s.stage_id} runs on ranks {list(ranks)}, which overlap the ranks "
                    f"{list(other)} of an earlier stage without being the same. A rank holds "
                    "several stages (model chunks) only when they have the same placement. Fix: "
                    "give both stages the same placement, or disjoint ones.")
        else:
            groups.append(ranks)
            g = len(groups) - 1
        position.append(g)
    p, n = len(groups), len(stages)
    if not training or schedule not in SCHEDULES:
        return position
    family = SCHEDULES[schedule].family
    have = [[sid for sid, g in enumerate(position) if g == r] for r in range(p)]
    if have != family.layout(p, n) or family.num_stages(p) not in (None, n):
        found = ", ".join(f"ranks {list(groups[r])}: stages {have[r]}" for r in range(p))
        raise GraphcError(f"pipeline schedule {family.needs(schedule, p, n)}; found {found}.")
    return position
