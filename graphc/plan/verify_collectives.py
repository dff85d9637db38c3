"""Check 2 of plan/verify.py: every rank of a collective's group issues it, the k-th with the k-th.

Each rank's k-th collective over a group must have the same kind, ranks, tensors (shapes,
dtypes) or conversion and dtype as every other member's k-th; a mismatch fails naming the odd
rank: a collective missing, extra, swapped or different. What an instruction class `joins`
its group in picks its signature and how a difference is said (_SIGNATURES, _DIFFERENCES).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Dict, List, Optional, Tuple

from .instructions import JOINS_CONVERSION, JOINS_TENSORS, Instruction
from .verify_failures import dtype_clash, fail


def is_collective(ins: Instruction) -> bool:
    """Whether `ins` waits for all ranks of its group: gradient buckets, tie, clip and output
    sums, ZeRO's scatters and gathers, and the boxing conversions list_collectives lists. What
    its class `joins` them in picks how the members pair (_SIGNATURES, _DIFFERENCES)."""
    return bool(ins.joins)


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
                fail(plan, i, f"rank {rank} issues a collective over ranks {list(ins.ranks)} "
                      "that it is not part of")
            world = world_size or len(by_rank)
            outside = [r for r in ins.ranks if (r not in by_rank if world_size is None else not 0 <= r < world)]
            if outside:
                fail(plan, i, f"ranks {outside} of this collective are outside the world of "
                      f"{world} ranks")
            group = tuple(sorted(ins.ranks))
            if group not in queues:
                for r in group if world_size is None else [r for r in group if r in by_rank]:
                    queues[group].setdefault(r, [])
            queues[group][rank].append((i, ins))
    return queues


def pair_collectives(by_rank, world_size: Optional[int] = None) -> List[List[Tuple[int, int]]]:
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
        fail(by_rank[ref], i, f"collective missing on rank {odd}: ranks {agree} issue it as "
              f"{where}; {instead}. The compiler passes that insert collectives must give every "
              "rank of the group the same one")
    i, ins = seqs[odd][k]
    if at(ref, k) is None or sigs[ref][k:] == sigs[odd][k + 1:]:
        fail(by_rank[odd], i, f"extra collective on rank {odd}: ranks {agree} issue no such "
              f"{where}")
    j0, ref_ins = seqs[ref][k]
    if at(odd, k) == at(ref, k + 1) and at(odd, k + 1) == at(ref, k):
        j = seqs[odd][k + 1][0]
        fail(by_rank[odd], i, f"collectives swapped on rank {odd}: it issues this (#{i}) before "
              f"`{seqs[odd][k + 1][1]}` (#{j}); rank {ref} issues them the other way round "
              f"(#{seqs[ref][k + 1][0]}, #{j0}), so {where} would pair different collectives")
    fail(by_rank[odd], i, f"{where} differs from rank {ref}'s `{ref_ins}` (#{j0})"
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
            what = " (a dtype mismatch)" if dtype_clash((a,), (b,)) else ""
            return f": rank {rank} reduces {a} where rank {other_rank} reduces {b}{what}"
    return ""


# a collective's entries by what it joins (its class's `joins`, plan/instructions.py)
_SIGNATURES = {JOINS_TENSORS: _tensors_signature, JOINS_CONVERSION: _conversion_signature}


_DIFFERENCES = {JOINS_TENSORS: _tensors_difference, JOINS_CONVERSION: _conversion_difference}
