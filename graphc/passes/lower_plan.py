"""lower_plan: turns stage programs and a schedule into one ExecutionPlan per rank.

Invariant: rank r's plan lists, in issue order, its stages' compute in schedule order,
each forward preceded by a recv of every value it reads from a stage on other ranks and
followed by a send of every value such a stage reads, each backward (or backward_input)
likewise for gradients, and one optimizer step at the end of a training step. Values
between two stages (chunks) on the same ranks are handed over in memory. Between stages of
one mesh shape replica k of a stage talks to replica k of the other; between meshes of other
shapes (n-to-m) each value moves in pieces, each receiver getting only its box of the value
from the senders that hold it, and each sender its gradient's box back (NOTE: Reshard
pieces in graphc/sbp/pieces.py; TensorSpec.at/of say where a piece sits).
A stage whose Prologue runs in the plan (feed_whole_sums) first runs its PrePass of every
micro-batch, each with the receives and sends of its pre-pass values (`0SEND_P3`), before
any instruction of the schedule; a rank's stages in stage order (NOTE: Whole-batch sums).
Requires: split_stages, feed_whole_sums.
"""
from __future__ import annotations

import functools
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

from ..plan.instructions import (ACT, GRAD, PRE, Backward, BackwardInput, Forward, Instruction,
                                 OptimizerStep, OverlapFB, PrePass, Recv, Send, TensorSpec)
from ..plan.plan import NO_CHECKPOINTING, ExecutionPlan, StageInfo
from ..plan.program import StageProgram
from ..plan.schedules import compute_order, pipeline_ranks


def lower_plan(programs: Sequence[StageProgram], stages: Sequence[StageInfo], schedule: str,
               num_microbatches: int, training: bool, world_size: int,
               checkpointing: str = NO_CHECKPOINTING,
               ranks: Optional[Sequence[int]] = None) -> List[ExecutionPlan]:
    """The plans of `ranks` (None: every rank of the world), in rank order. See NOTE: Plans
    of some ranks."""
    chosen = range(world_size) if ranks is None else sorted(set(ranks))
    listing = _Listing(programs, stages, schedule, num_microbatches, training)
    listed = {rank: listing.instructions(rank) for rank in chosen}
    # a send's place follows its receiver's order, so the receivers' lists are made too
    receivers = {ins.peer for instrs in listed.values() for ins in instrs if isinstance(ins, Send)}
    heard = {**{q: listing.instructions(q) for q in sorted(receivers - set(listed))}, **listed}
    wanted = _receive_orders(heard)
    checkpointing = checkpointing if training else NO_CHECKPOINTING
    return [ExecutionPlan(rank, world_size, _in_receive_order(rank, listed[rank], wanted),
                          num_microbatches, schedule, tuple(stages), training, checkpointing=checkpointing)
            for rank in chosen]


# NOTE: Plans of some ranks
# A rank runs one plan, so it lowers one (graphc/compiler.py: compile's `ranks`): its compute
# order and transfers come from the stage programs and the schedule alone, except where its
# sends go in a channel, which follows the order its receiver posts the receives in
# (_in_receive_order). So lowering a set of ranks also lists the instructions of the ranks they
# send to, and keeps only its own. A rank's plan lowered alone is the plan the whole world's
# lowering gives it (tests/passes/test_lower_plan.py checks it for every layout family); what
# its peers must agree with is checked at startup (runtime/agreement.py; NOTE: Plan digests).
class _Listing:
    """Each rank's compute order with its receives and sends, before sends are reordered;
    ranks of one pipeline position share one compute order."""

    def __init__(self, programs, stages, schedule: str, num_microbatches: int, training: bool):
        self.programs, self.stages, self.schedule = programs, stages, schedule
        self.m, self.training = num_microbatches, training
        self.position = pipeline_ranks(stages, schedule, training)
        self.pp_rank_of = {r: self.position[s.stage_id] for s in stages for r in s.ranks}
        self.orders: Dict[int, List[Instruction]] = {}

    def instructions(self, rank: int) -> List[Instruction]:
        instrs: List[Instruction] = []
        if rank in self.pp_rank_of:
            instrs = _with_p2p(self._order(self.pp_rank_of[rank]), self.programs, self.stages, rank)
        if self.training:
            instrs.append(OptimizerStep())
        return instrs

    def _order(self, pos: int) -> List[Instruction]:
        if pos not in self.orders:
            if self.training:
                order = compute_order(self.schedule, pos, max(self.position) + 1, len(self.stages), self.m, True)
            else:  # each chunk's forwards, chunks in stage order
                order = [Forward(s, i) for s, g in enumerate(self.position) if g == pos for i in range(self.m)]
            self.orders[pos] = self._pre_passes(pos) + order
        return self.orders[pos]

    def _pre_passes(self, pos: int) -> List[Instruction]:
        """Before the schedule: each of the position's stages whose Prologue runs in the plan,
        every micro-batch, stages in order (NOTE: Whole-batch sums)."""
        return [PrePass(s, i) for s, g in enumerate(self.position) if g == pos
                and self.programs[s].prologue is not None and self.programs[s].prologue.in_plan
                for i in range(self.m)]


def _source(stages: Sequence[StageInfo], rank: int, mine: int, other: int) -> int:
    """The replica of stage `other` that replica k of stage `mine` receives from."""
    theirs = stages[other].ranks
    return theirs[stages[mine].ranks.index(rank) % len(theirs)]


def _targets(stages: Sequence[StageInfo], rank: int, mine: int, other: int) -> Tuple[int, ...]:
    """The replicas of stage `other` that receive from replica k of stage `mine`."""
    return _replicas_fed(tuple(stages[mine].ranks), tuple(stages[other].ranks), rank)


@functools.lru_cache(maxsize=65536)   # asked once per transfer: 10^5 times at a thousand ranks
def _replicas_fed(mine: Tuple[int, ...], theirs: Tuple[int, ...], rank: int) -> Tuple[int, ...]:
    k, n = mine.index(rank), len(mine)
    return tuple(r for j, r in enumerate(theirs) if j % n == k)


def _with_p2p(order, programs, stages, rank) -> List[Instruction]:
    """Each compute instruction wrapped in its receives and sends. A value between two chunks
    of this rank (stages on the same ranks) is handed over in memory: no transfer is listed."""
    transfers = _Transfers(programs, stages, rank)
    out: List[Instruction] = []
    for ins in order:
        if isinstance(ins, OverlapFB):
            f, b = ins.forward, ins.backward
            out += transfers.around(f, True) + transfers.around(b, True)
            out.append(ins)
            out += transfers.around(f, False) + transfers.around(b, False)
        else:
            out += transfers.around(ins, True) + [ins] + transfers.around(ins, False)
    return out


class _Transfers:
    """One rank's receives before, and sends after, each compute. They differ between the
    micro-batches of a (compute kind, stage) only in its number, so each one's peers and
    payloads are worked out once (10^5 times fewer at thousands of ranks)."""

    def __init__(self, programs, stages, rank: int):
        self.programs, self.stages, self.rank = programs, stages, rank
        self.worked_out: Dict[tuple, list] = {}

    def around(self, ins, before: bool) -> List[Instruction]:
        """The receives before `ins` (before=True) or the sends after it."""
        if not isinstance(ins, (Forward, Backward, BackwardInput, PrePass)):
            return []
        key = (type(ins) if type(ins) is not BackwardInput else Backward, ins.stage, before)
        if key not in self.worked_out:
            find = _pre_pass_transfers if key[0] is PrePass else _recvs if before else _sends
            args = (before,) if key[0] is PrePass else (key[0] is Forward,)
            self.worked_out[key] = find(*args, ins.stage, self.programs, self.stages, self.rank)
        return [kind(ins.stage, ins.microbatch, peer, direction, other, payload)
                for kind, peer, direction, other, payload in self.worked_out[key]]


def _local(stages, rank: int, other: int) -> bool:
    return rank in stages[other].ranks


def _recvs(forward: bool, s: int, programs, stages, rank) -> List[tuple]:
    """(Recv, peer, direction, peer stage, payload) of what stage s receives before its
    forward (or backward) on this rank."""
    prog = programs[s]
    out: List[tuple] = []
    if forward:
        for a, specs in sorted(prog.recv_from.items()):
            if not _local(stages, rank, a):
                for src, got in _by_peer(prog, specs, s, rank, (_source(stages, rank, s, a),),
                                         receiving=True, grad=False):
                    out.append((Recv, src, ACT, a, got))
        return out
    for b, specs in sorted(prog.send_to.items()):
        grads = prog.grad_specs(specs)
        if grads and not _local(stages, rank, b):
            for src, got in _by_peer(prog, grads, b, rank, (_source(stages, rank, s, b),),
                                     receiving=True, grad=True):
                out.append((Recv, src, GRAD, b, got))
    return out


def _pre_pass_transfers(before: bool, s: int, programs, stages, rank) -> List[tuple]:
    """(Recv, ...) of what stage s's pre-pass receives (before=True), or (Send, ...) of what it
    sends: the values later stages' pre-passes read, as the forward moves them."""
    prog, pro = programs[s], programs[s].prologue
    out: List[tuple] = []
    for other, specs in sorted((pro.recv_from if before else pro.send_to).items()):
        if _local(stages, rank, other):
            continue
        receiver = s if before else other
        peers = (_source(stages, rank, s, other),) if before else _targets(stages, rank, s, other)
        for peer, moved in _by_peer(prog, specs, receiver, rank, peers, receiving=before, grad=False):
            out.append((Recv if before else Send, peer, PRE, other, moved))
    return out


def _sends(forward: bool, s: int, programs, stages, rank) -> List[tuple]:
    """(Send, peer, direction, peer stage, payload) of what stage s sends after its forward
    (or backward) on this rank."""
    prog = programs[s]
    out: List[tuple] = []
    if forward:
        for b, specs in sorted(prog.send_to.items()):
            if not _local(stages, rank, b):
                for peer, sent in _by_peer(prog, specs, b, rank, _targets(stages, rank, s, b),
                                           receiving=False, grad=False):
                    out.append((Send, peer, ACT, b, sent))
        return out
    for a, specs in sorted(prog.recv_from.items()):
        grads = prog.grad_specs(specs)
        if grads and not _local(stages, rank, a):
            for peer, sent in _by_peer(prog, grads, s, rank, _targets(stages, rank, s, a),
                                       receiving=False, grad=True):
                out.append((Send, peer, GRAD, a, sent))
    return out


def _by_peer(prog, specs, receiver: int, rank: int, replicas, receiving: bool,
             grad: bool) -> List[Tuple[int, Tuple[TensorSpec, ...]]]:
    """(peer, tensors) of one boundary's transfers on this rank, peers in rank order, each
    payload in the boundary's order. A value moving between meshes of one shape goes whole
    to (or from) `replicas` (one rank to receive from, the ranks to send to), in the shape the
    computing replica holds it; one moving between meshes of other shapes (`prog.reshard`,
    keyed by the receiving stage) goes in pieces (NOTE: Reshard pieces)."""
    payload: Dict[int, List[TensorSpec]] = defaultdict(list)
    for spec in specs:
        moved = prog.reshard.get((spec.name, receiver))
        if moved is None:
            for peer in replicas:
                whole = prog.specs_of([spec], peer if receiving != grad else rank)[0]
                payload[peer].append(whole)
            continue
        if receiving:
            for p in moved.received_by(rank, grad):
                payload[p.src].append(TensorSpec(spec.name, p.shape, spec.dtype, p.dst_at, p.dst_of))
        else:
            for p in moved.sent_by(rank, grad):
                payload[p.dst].append(TensorSpec(spec.name, p.shape, spec.dtype, p.src_at, p.src_of))
    return [(peer, tuple(payload[peer])) for peer in sorted(payload)]


def _receive_orders(listed: Dict[int, List[Instruction]]) -> Dict[Tuple[int, int], List[tuple]]:
    """(src, dst) -> the transfers dst receives from src, in the order it posts them."""
    wanted: Dict[Tuple[int, int], List[tuple]] = defaultdict(list)
    for rank, instrs in listed.items():
        for ins in instrs:
            if isinstance(ins, Recv):
                wanted[(ins.peer, rank)].append((ins.peer_stage, ins.stage, ins.direction, ins.microbatch))
    return wanted


def _in_receive_order(rank: int, instrs: List[Instruction],
                      wanted: Dict[Tuple[int, int], List[tuple]]) -> List[Instruction]:
    """Moves sends later where needed so that each channel (src -> dst) carries its transfers
    in the order dst receives them: transports are FIFO per channel (shared-memory rings,
    NCCL). With one stage per rank the orders agree already; with several chunks per rank
    they need not (a skip connection from chunk 0 to chunk 3 is sent at 0F0 but received at
    3F0, after 1F1's input). A send goes out right after its compute, or, if an earlier
    transfer of its channel (in dst's order) is not computed yet, right after that one.
    Sends never block compute (send actors), so this only delays them; verify_plans proves
    the result deadlock-free.
    """
    out: List[Instruction] = []
    pending: Dict[Tuple[int, int], Dict[tuple, Send]] = defaultdict(dict)
    nxt: Dict[Tuple[int, int], int] = defaultdict(int)
    for ins in instrs:
        if not isinstance(ins, Send):
            if isinstance(ins, OptimizerStep):  # nothing may stay behind (verify flags a mismatch)
                out += [s for q in pending.values() for s in q.values()]
                pending.clear()
            out.append(ins)
            continue
        ch = (rank, ins.peer)
        pending[ch][(ins.stage, ins.peer_stage, ins.direction, ins.microbatch)] = ins
        order = wanted.get(ch, [])
        while nxt[ch] < len(order) and order[nxt[ch]] in pending[ch]:
            out.append(pending[ch].pop(order[nxt[ch]]))
            nxt[ch] += 1
    out += [s for q in pending.values() for s in q.values()]
    return out
