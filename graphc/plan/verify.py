"""Verifies a set of per-rank plans before anything runs.

Every rank can compute every rank's plan, so one process checks that:
  1. each send meets a recv on its peer, in the same order, with equal payload specs
     (shapes and dtypes: the receiver's buffer is made from its own spec);
  2. each collective the plans list (gradient bucket, tie or clip all-reduce, the boxing
     collectives list_collectives adds) is issued by exactly its ranks: each rank's k-th
     collective over a group has the same kind, ranks, tensors (shapes, dtypes) or
     conversion and dtype as every other member's k-th (a differing dtype is named as such:
     the members would exchange buffers of other sizes and types). A prologue's sum (feed_whole_batch), which
     the runtime runs before a step's instructions, is not listed and not checked here; a
     pre-pass's (PrePass, NOTE: Whole-batch sums) transfers and collectives are, like the step's;
  3. the union of all plans, with sends joined to their recvs and collectives joined
     across ranks, is acyclic (so no rank can wait forever on another); a cycle is
     printed rank by rank;
  4. each rank computes every (stage, micro-batch) it starts as a program: one forward,
     then one backward, whole (B) or split into I and, after it, W; in training, all of it;
     a stage's pre-pass (P) comes before its first forward;
  5. under ZeRO, each sharded gradient is reduce-scattered once, over one group, all-reduced
     by nothing else, and its rows gathered over that group (verify_zero.py).
A failure raises PlanError naming the rank and instruction, with the plan listing marked.
"""
from __future__ import annotations

from collections import Counter, defaultdict, deque
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import PlanError
from .instructions import (COMPUTE_RUNS, JOINS_CONVERSION, JOINS_TENSORS, STAGE_COMPUTES, Backward,
                           BackwardInput, BackwardWeight, Forward, Instruction, PrePass, Recv, Send)
from .plan import ExecutionPlan
from .verify_zero import check_zero_groups


def is_collective(ins: Instruction) -> bool:
    """Whether `ins` waits for all ranks of its group: gradient buckets, tie, clip and output
    sums, ZeRO's scatters and gathers, and the boxing conversions list_collectives lists. What
    its class `joins` them in picks how the members pair (_SIGNATURES, _DIFFERENCES)."""
    return bool(ins.joins)


def verify_plans(plans: Sequence[ExecutionPlan], world_size: Optional[int] = None,
                 quotient: bool = False) -> None:
    """Raises PlanError if the plans cannot run together to completion.

    world_size: the job's ranks, when `plans` are only some of them (a rank's own compile,
    NOTE: Plans of some ranks): then each plan's compute order is checked (4) and its peers
    lie in the world; pairing (1, 2) is checked at startup between the ranks themselves
    (NOTE: Plan digests, runtime/agreement.py), and deadlock freedom (3) by `graphc plan`.
    quotient: `plans` are the templates of a symmetric world (NOTE: Plan templates), checked
    in full as a world whose groups' members are the members among them.
    """
    by_rank = {p.rank: p for p in plans}
    checked = set()   # ranks of one pipeline position list the very same compute objects
    zero_checked: set = set()   # and ranks of one ZeRO group the same gradient collectives
    for plan in plans:
        computes = (plan.training, plan.schedule, *(id(i) for i in plan.instructions if i.runs in COMPUTE_RUNS))
        if computes not in checked:
            _check_compute_order(plan)
            checked.add(computes)
        check_zero_groups(plan, _fail, zero_checked)
    if world_size is not None and len(by_rank) < world_size and not quotient:
        for plan in plans:
            _check_peers_in_world(plan, world_size)
        return
    pairs = _pair_p2p(by_rank)
    groups = _pair_collectives(by_rank, world_size if quotient else None)
    _check_acyclic(by_rank, pairs, groups)


def _check_peers_in_world(plan: ExecutionPlan, world_size: int) -> None:
    for i, ins in enumerate(plan.instructions):
        peers = [ins.peer] if ins.runs in (Send.runs, Recv.runs) else \
            list(ins.ranks) if is_collective(ins) else []
        outside = [r for r in peers if not 0 <= r < world_size]
        if outside:
            _fail(plan, i, f"rank(s) {outside} are outside the world of {world_size} ranks")
        if is_collective(ins) and plan.rank not in ins.ranks:
            _fail(plan, i, f"rank {plan.rank} issues a collective over ranks {list(ins.ranks)} "
                  "that it is not part of")


def _fail(plan: ExecutionPlan, index: int, why: str) -> None:
    raise PlanError(f"plan verification failed on rank {plan.rank}, instruction #{index} "
                    f"`{plan.instructions[index]}`: {why}\n{plan.format(mark=index)}")


# the compute of one (stage, micro-batch) on its rank, in order: a whole or a split backward
_PROGRAMS = (Forward.letter + Backward.letter,
             Forward.letter + BackwardInput.letter + BackwardWeight.letter)


def _check_compute_order(plan: ExecutionPlan) -> None:
    """Fails unless each (stage, micro-batch) runs F, then B or I then W, each once (check 4)."""
    seen: Dict[Tuple[int, int], str] = {}
    last: Dict[Tuple[int, int], int] = {}
    forwarded = set()   # stages whose forward has begun
    for i, ins in enumerate(plan.instructions):
        parts = ins.parts
        for part in parts:
            if type(part) is PrePass and part.stage in forwarded:
                _fail(plan, i, f"`{part}` comes after a forward of stage {part.stage}: a stage's "
                      "pre-pass (NOTE: Whole-batch sums) gives every micro-batch's forward its totals, "
                      "so lower_plan lists it before the schedule")
            if type(part) not in STAGE_COMPUTES:
                continue
            if type(part) is Forward:
                forwarded.add(part.stage)
            key, step = (part.stage, part.microbatch), part.letter
            done = seen.get(key, "")
            if not any(prog.startswith(done + step) for prog in _PROGRAMS):
                _fail(plan, i, _misordered(part, done, step, plan.schedule))
            seen[key], last[key] = done + step, i
    for key, done in seen.items():
        if plan.training and done not in _PROGRAMS:
            missing = "B (or I and W)" if done == "F" else "W"
            _fail(plan, last[key], f"stage {key[0]} micro-batch {key[1]} ran {'+'.join(done)} "
                  f"and never its {missing}: its backward is incomplete. The schedule "
                  f"'{plan.schedule}' (graphc/plan/schedules.py) must list it")


def _misordered(part: Instruction, done: str, step: str, schedule: str) -> str:
    after = "+".join(done) or "nothing"
    what = f"`{part}` (stage {part.stage} micro-batch {part.microbatch}, after {after})"
    if step in done:
        why = f"{what} runs a second time"
    elif step == BackwardWeight.letter:
        why = f"{what} comes before its I: a weight gradient needs the input gradient's pass first"
    elif not done:
        why = f"{what} comes before its forward"
    else:
        why = f"{what} mixes a whole backward (B) with a split one (I, W)"
    return (f"{why}. Each (stage, micro-batch) runs F, then B or I then W, each once; the "
            f"schedule '{schedule}' (graphc/plan/schedules.py) or a pass that moved compute broke it")


def _p2p_queues(by_rank) -> Dict[Tuple[int, int], Dict[str, List[Tuple[int, Instruction]]]]:
    """(src, dst) -> {'send': [(idx, Send)...] on src, 'recv': [(idx, Recv)...] on dst}."""
    queues = defaultdict(lambda: {"send": [], "recv": []})
    for rank, plan in by_rank.items():
        for i, ins in enumerate(plan.instructions):
            if ins.runs == Send.runs:
                if ins.peer not in by_rank:
                    _fail(plan, i, f"peer rank {ins.peer} is outside the world of {len(by_rank)} ranks")
                queues[(rank, ins.peer)]["send"].append((i, ins))
            elif ins.runs == Recv.runs:
                if ins.peer not in by_rank:
                    _fail(plan, i, f"peer rank {ins.peer} is outside the world of {len(by_rank)} ranks")
                queues[(ins.peer, rank)]["recv"].append((i, ins))
    return queues


def _pair_p2p(by_rank) -> List[Tuple[Tuple[int, int], Tuple[int, int]]]:
    pairs = []
    for (src, dst), q in sorted(_p2p_queues(by_rank).items()):
        sends, recvs = q["send"], q["recv"]
        for k in range(max(len(sends), len(recvs))):
            if k < len(sends) and k < len(recvs) and _same_transfer(sends[k][1], recvs[k][1]):
                (i, s), (j, r) = sends[k], recvs[k]
                if s.tensors != r.tensors:
                    _fail(by_rank[dst], j, f"{_dtype_clash(s.tensors, r.tensors) or 'payload'} "
                          f"mismatch with rank {src} #{i}: sent [{' '.join(map(str, s.tensors))}], "
                          f"expected [{' '.join(map(str, r.tensors))}]")
                pairs.append(((src, i), (dst, j)))
                continue
            counts = f"rank {src} sends {len(sends)} to rank {dst}, which posts {len(recvs)} recvs"
            if len(sends) > len(recvs):
                _fail(by_rank[src], sends[k][0], f"no matching recv on rank {dst} ({counts})")
            if len(recvs) > len(sends):
                _fail(by_rank[dst], recvs[k][0], f"no matching send on rank {src} ({counts})")
            (i, s), (j, r) = sends[k], recvs[k]
            _fail(by_rank[dst], j, f"out of order: the {k}-th transfer from rank {src} is "
                  f"`{s}` (rank {src} #{i}) but rank {dst} expects `{r}`")
    return pairs


def _dtype_clash(a, b) -> str:
    """'dtype' when two payloads differ only in their tensors' dtypes, else ''."""
    same_shapes = len(a) == len(b) and all((x.name, x.shape) == (y.name, y.shape) for x, y in zip(a, b))
    return "dtype" if same_shapes and any(x.dtype != y.dtype for x, y in zip(a, b)) else ""


def _same_transfer(s: Send, r: Recv) -> bool:
    return (s.microbatch == r.microbatch and s.direction == r.direction
            and s.stage == r.peer_stage and s.peer_stage == r.stage)


def signature(ins: Instruction) -> tuple:
    """What must agree on every rank of a collective's group for the ranks to pair up."""
    return _SIGNATURES[ins.joins](ins)


def _tensors_signature(ins: Instruction) -> tuple:
    """A sum, gather or scatter of named tensors: its kind, ranks, tensors (shapes, dtypes)
    and a clip's bound. Tie and clip collectives leave out their per-rank `params` (see
    their docstrings)."""
    return (type(ins).__name__, ins.ranks, ins.tensors, getattr(ins, "max_norm", None))


def _conversion_signature(ins: Instruction) -> tuple:
    """A boxing conversion: its `nbytes` is what this rank sends, which may differ by rank (an
    uneven split), so it is left out; the conversion node fixes the shapes and dtype, since
    every rank of a group runs the same stage program."""
    return ("collective", ins.kind, ins.ranks, ins.stage, ins.microbatch, ins.direction,
            ins.node, ins.sbp_in, ins.sbp_out, ins.dtype)


def _collective_queues(by_rank, world_size: Optional[int] = None
                       ) -> Dict[Tuple[int, ...], Dict[int, List[Tuple[int, Instruction]]]]:
    """group (sorted ranks) -> rank -> [(index, collective)...] in that rank's issue order.
    world_size: of a quotient (NOTE: Plan templates), whose groups' members are those in
    `by_rank`; other members must lie in the world."""
    queues: Dict[Tuple[int, ...], Dict[int, List[Tuple[int, Instruction]]]] = defaultdict(dict)
    for rank, plan in by_rank.items():
        for i, ins in enumerate(plan.instructions):
            if not is_collective(ins):
                continue
            if rank not in ins.ranks:
                _fail(plan, i, f"rank {rank} issues a collective over ranks {list(ins.ranks)} "
                      "that it is not part of")
            world = world_size or len(by_rank)
            outside = [r for r in ins.ranks if (r not in by_rank if world_size is None else not 0 <= r < world)]
            if outside:
                _fail(plan, i, f"ranks {outside} of this collective are outside the world of "
                      f"{world} ranks")
            group = tuple(sorted(ins.ranks))
            if group not in queues:
                for r in group if world_size is None else [r for r in group if r in by_rank]:
                    queues[group].setdefault(r, [])
            queues[group][rank].append((i, ins))
    return queues


def _pair_collectives(by_rank, world_size: Optional[int] = None) -> List[List[Tuple[int, int]]]:
    """Pairs each rank's k-th collective over a group with the other members' k-th.

    Gradient buckets, tie and clip all-reduces and boxing collectives over one group share
    one queue: a rank issuing them in another order than its peers would pair (and hang)
    with the wrong partner. Returns each collective as its members' (rank, index).
    """
    hubs = []
    for group, seqs in sorted(_collective_queues(by_rank, world_size).items()):
        group = tuple(seqs)   # its members here (of a quotient: those among the templates)
        if not _same_objects(seqs, group):   # list_collectives gives a group's members one object each
            sigs = {r: [signature(ins) for _, ins in seqs[r]] for r in group}
            for k in range(max(len(s) for s in sigs.values())):
                if len({s[k] if k < len(s) else None for s in sigs.values()}) > 1:
                    _explain_mismatch(by_rank, group, seqs, sigs, k)
        hubs += [[(r, seqs[r][k][0]) for r in group] for k in range(len(seqs[group[0]]))]
    return hubs


def _same_objects(seqs, group) -> bool:
    """Whether every member lists the very same instruction objects (then they agree)."""
    first = [ins for _, ins in seqs[group[0]]]
    return all(len(seqs[r]) == len(first) and all(a is b for (_, a), b in zip(seqs[r], first))
               for r in group[1:])


def _explain_mismatch(by_rank, group, seqs, sigs, k: int) -> None:
    """Fails naming the odd rank: a collective missing, extra, swapped or different."""
    def at(r, j):
        return sigs[r][j] if j < len(sigs[r]) else None
    votes = Counter(at(r, k) for r in group)
    # the reference is the k-th collective most ranks agree on (then the longest sequence)
    ref = min(group, key=lambda r: (-votes[at(r, k)], at(r, k) is None, -len(sigs[r]), r))
    odd = next(r for r in group if at(r, k) != at(ref, k))
    agree = [r for r in group if at(r, k) == at(ref, k)]
    where = f"collective #{k} over ranks {list(group)}"
    if at(ref, k) is not None and (at(odd, k) is None or sigs[odd][k:] == sigs[ref][k + 1:]):
        i, ins = seqs[ref][k]
        instead = (f"rank {odd} issues `{seqs[odd][k][1]}` (#{seqs[odd][k][0]}) there instead"
                   if at(odd, k) is not None else f"rank {odd} issues no more collectives there")
        _fail(by_rank[ref], i, f"collective missing on rank {odd}: ranks {agree} issue it as "
              f"{where}; {instead}. The compiler passes that insert collectives must give every "
              "rank of the group the same one")
    i, ins = seqs[odd][k]
    if at(ref, k) is None or sigs[ref][k:] == sigs[odd][k + 1:]:
        _fail(by_rank[odd], i, f"extra collective on rank {odd}: ranks {agree} issue no such "
              f"{where}")
    j0, ref_ins = seqs[ref][k]
    if at(odd, k) == at(ref, k + 1) and at(odd, k + 1) == at(ref, k):
        j = seqs[odd][k + 1][0]
        _fail(by_rank[odd], i, f"collectives swapped on rank {odd}: it issues this (#{i}) before "
              f"`{seqs[odd][k + 1][1]}` (#{j}); rank {ref} issues them the other way round "
              f"(#{seqs[ref][k + 1][0]}, #{j0}), so {where} would pair different collectives")
    _fail(by_rank[odd], i, f"{where} differs from rank {ref}'s `{ref_ins}` (#{j0})"
          f"{_difference(ins, ref_ins, odd, ref)}")


def _difference(ins: Instruction, other: Instruction, rank: int, other_rank: int) -> str:
    """How two same-kind collectives differ: the first differing tensor of two all-reduces (a
    gradient bucket's shapes), or a conversion's dtype."""
    if type(ins) is not type(other):
        return ""
    return _DIFFERENCES[ins.joins](ins, other, rank, other_rank)


def _conversion_difference(ins: Instruction, other: Instruction, rank: int, other_rank: int) -> str:
    if ins.dtype != other.dtype and signature(ins)[:-1] == signature(other)[:-1]:
        return (f": dtype {ins.dtype or '?'} on rank {rank}, {other.dtype or '?'} on rank "
                f"{other_rank}; every member of a collective must send the same dtype")
    return ""


def _tensors_difference(ins: Instruction, other: Instruction, rank: int, other_rank: int) -> str:
    if ins.ranks != other.ranks:
        return f": ranks {list(ins.ranks)} here, {list(other.ranks)} there"
    if len(ins.tensors) != len(other.tensors):
        return f": {len(ins.tensors)} tensors here, {len(other.tensors)} on rank {other_rank}"
    for a, b in zip(ins.tensors, other.tensors):
        if a != b:
            what = " (a dtype mismatch)" if _dtype_clash((a,), (b,)) else ""
            return f": rank {rank} reduces {a} where rank {other_rank} reduces {b}{what}"
    return ""


# a collective's entries by what it joins (its class's `joins`, plan/instructions.py)
_SIGNATURES = {JOINS_TENSORS: _tensors_signature, JOINS_CONVERSION: _conversion_signature}
_DIFFERENCES = {JOINS_TENSORS: _tensors_difference, JOINS_CONVERSION: _conversion_difference}


def _check_acyclic(by_rank, pairs, hubs) -> None:
    """Fails if the wait-for graph of all plans has a cycle (a deadlock), rank by rank.

    Nodes are instructions, plus one node per collective that every member joins: it waits
    for each member's previous instruction and its members' collective instructions wait
    for it. Sends do not block (isend), so a send only makes its recv wait. Each rank's
    nodes form a chain, so the graph is acyclic exactly when walking every rank's pointer
    through its plan, passing a recv once its send is passed and a collective once every
    member has reached it, ends every plan: linear in the number of instructions.
    """
    walk = _Walk(by_rank, pairs, hubs)
    walk.run()
    if any(walk.pc[r] < len(p.instructions) for r, p in by_rank.items()):
        _fail_deadlock(by_rank, walk.cycle(), hubs)


class _Walk:
    """The pointer walk of _check_acyclic: a worklist of ranks that may move on."""

    def __init__(self, by_rank, pairs, hubs):
        self.by_rank, self.hubs = by_rank, hubs
        self.pc = {r: 0 for r in by_rank}
        self.send_for = {r: {} for r in by_rank}     # rank -> recv index -> (rank, send index)
        for send, (r, i) in pairs:
            self.send_for[r][i] = send
        self.hub_at = {r: {} for r in by_rank}       # rank -> index -> collective (hub) number
        for k, members in enumerate(hubs):
            for r, i in members:
                self.hub_at[r][i] = k
        self.arrived = [0] * len(hubs)
        # sender -> its send's index -> the ranks whose recv waits on it
        self.woken_by: Dict[int, Dict[int, List[int]]] = {r: {} for r in by_rank}

    def run(self) -> None:
        ready = deque(self.by_rank)
        while ready:
            ready.extend(self._advance(ready.popleft()))

    def _advance(self, r: int) -> List[int]:
        """Moves rank r on until it must wait; returns the ranks its progress frees."""
        freed: List[int] = []
        n, sends, hub_at, pc = len(self.by_rank[r].instructions), self.send_for[r], self.hub_at[r], self.pc
        waiting = self.woken_by[r]   # no other rank moves while this one does: pc[r] is written on leaving
        i = pc[r]
        while i < n:
            send = sends.get(i)
            if send is not None and pc[send[0]] <= send[1]:
                self.woken_by[send[0]].setdefault(send[1], []).append(r)
                pc[r] = i
                return freed
            k = hub_at.get(i)
            if k is not None and self.arrived[k] < len(self.hubs[k]):
                self.arrived[k] += 1
                if self.arrived[k] < len(self.hubs[k]):
                    pc[r] = i
                    return freed
                freed += [m for m, _ in self.hubs[k] if m != r]   # the last member opens it
            if waiting and i in waiting:
                freed += waiting.pop(i)
            i += 1
        pc[r] = i
        return freed

    def _waits_on(self, r: int) -> Tuple[int, int, object]:
        """(rank, index it must pass, link) for a stuck rank r; link is a hub number or None."""
        i = self.pc[r]
        send = self.send_for[r].get(i)
        if send is not None and self.pc[send[0]] <= send[1]:
            return send[0], send[1], None
        k = self.hub_at[r][i]
        m, j = next((m, j) for m, j in self.hubs[k] if self.pc[m] < j)
        return m, j - 1, k

    def cycle(self) -> list:
        """The cycle among stuck ranks as wait-for graph nodes, in edge order."""
        r = next(r for r, p in self.by_rank.items() if self.pc[r] < len(p.instructions))
        order: List[int] = []
        while r not in order:
            order.append(r)
            r = self._waits_on(r)[0]
        ring = order[order.index(r):]          # ring[t] waits on ring[t + 1]
        nodes: list = []
        for t in reversed(range(len(ring))):   # each waited-on rank before its waiter
            rank, target, hub = self._waits_on(ring[t])
            nodes += [(rank, i) for i in self._segment(rank, target)]
            nodes += [("collective", hub)] if hub is not None else []
        return nodes

    def _segment(self, rank: int, target: int) -> List[int]:
        """Where a stuck rank waits, the collectives it must pass first, and `target`."""
        plan, start = self.by_rank[rank], self.pc[rank]
        between = [i for i in range(start + 1, target)
                   if is_collective(plan.instructions[i])]
        return [start] + between + ([target] if target > start else [])


def _fail_deadlock(by_rank, cycle, hubs) -> None:
    involved: Dict[int, set] = defaultdict(set)
    steps = []
    for node in cycle:
        if node[0] == "collective":
            members = hubs[node[1]]
            for r, i in members:
                involved[r].add(i)
            r, i = members[0]
            steps.append(f"`{by_rank[r].instructions[i]}` joined by "
                         + ", ".join(f"rank {r} #{i}" for r, i in members))
        else:
            involved[node[0]].add(node[1])
            steps.append(f"rank {node[0]} #{node[1]}")
    lines = [f"  rank {r}: " + ", ".join(f"#{i} `{by_rank[r].instructions[i]}`" for i in sorted(ix))
             for r, ix in sorted(involved.items())]
    first = min(involved)
    listings = "\n".join(_marked_listing(by_rank[r], involved[r]) for r in sorted(involved))
    raise PlanError(
        f"plan verification failed on rank {first}, instruction #{min(involved[first])}: "
        f"deadlock: these instructions wait on each other in a cycle, rank by rank:\n"
        + "\n".join(lines) + "\n  cycle: " + " -> ".join(steps + steps[:1]) + "\n"
        "Fix: order the sends, recvs and collectives alike on every rank of a group.\n" + listings)


def _marked_listing(plan: ExecutionPlan, marks, context: int = 3) -> str:
    """The rank's listing around the marked instructions, each flagged `<-- ERROR HERE`."""
    lines = str(plan).splitlines()
    head = len(lines) - len(plan.instructions)   # the header, stages and notes lines
    keep = set(range(head)) | {j for i in marks for j in range(i + head - context, i + head + 1 + context)
                               if head <= j < len(lines)}
    out, last = [], 0
    for j in sorted(keep):
        if j > last + 1:
            out.append("   ...")
        out.append(lines[j] + ("   <-- ERROR HERE" if j - head in marks else ""))
        last = j
    if last < len(lines) - 1:
        out.append("   ...")
    return "\n".join(out)
