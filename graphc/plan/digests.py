"""What a rank's peers must agree with, as short digests that ranks compare at startup.

NOTE: Plan digests
A rank lowers only its own plan (NOTE: Plans of some ranks, passes/lower_plan.py), so no
process holds the plans that verify_plans pairs up. What pairing needs of a plan is small:
per group it issues collectives over, the sequence of their signatures (kind, ranks,
tensors or conversion, dtype: plan/verify.py's `signature`), and per channel it sends or
receives on, the sequence of transfers (stages, direction, micro-batch, payload). Each is
hashed to a digest; the ranks exchange digests at startup with the rank-agreement facts
(NOTE: Rank agreement, runtime/agreement.py), and every rank finds the same first key whose
holders disagree: a group's members, or a channel's two ends, must have equal digests, and
a member without the key issues none of them. Only the two ranks named (the odd one and a
reference that most members agree with) then publish that key's sequence, so the error
names both ranks and the first instruction where they part, as the verifier would.
Deadlock freedom is a property of the whole world's plans, which `graphc plan` verifies.
"""
from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

from .instructions import Instruction, Recv, Send
from .plan import ExecutionPlan, _fmt_ranks, parse_ranks
from .verify import is_collective, signature

GROUP = "collectives over "    # key of a group's collective sequence: `collectives over 0..3`
CHANNEL = "transfers "         # key of a channel's: `transfers 0->4`

# (plan index, printed instruction, signature) of one key's sequence on one rank
Entry = Tuple[int, str, str]


def plan_sequences(plan: ExecutionPlan) -> Dict[str, List[Entry]]:
    """Per group and channel of this rank, its instructions there in issue order."""
    seqs: Dict[str, List[Entry]] = defaultdict(list)
    for i, ins in enumerate(plan.instructions):
        key, sig = _keyed(plan.rank, ins)
        if key is not None:
            seqs[key].append((i, str(ins), sig))
    return dict(seqs)


def plan_digests(plan: ExecutionPlan) -> Dict[str, str]:
    """Per group and channel of this rank: `<hash>:<count>` of its sequence there."""
    return {key: _digest(entries) for key, entries in plan_sequences(plan).items()}


def _keyed(rank: int, ins: Instruction) -> Tuple[Optional[str], str]:
    if is_collective(ins):
        return GROUP + _fmt_ranks(tuple(sorted(ins.ranks))), repr(signature(ins))
    if ins.runs == Send.runs:
        return channel_key(rank, ins.peer), _transfer(ins.stage, ins.peer_stage, ins)
    if ins.runs == Recv.runs:
        return channel_key(ins.peer, rank), _transfer(ins.peer_stage, ins.stage, ins)
    return None, ""


def channel_key(src: int, dst: int) -> str:
    return f"{CHANNEL}{src}->{dst}"


def _transfer(src_stage: int, dst_stage: int, ins) -> str:
    """A transfer as both ends list it: a piece's offsets differ by end and are left out."""
    payload = tuple((t.name, t.shape, t.dtype) for t in ins.tensors)
    return repr((src_stage, dst_stage, ins.direction, ins.microbatch, payload))


def _digest(entries: Sequence[Entry]) -> str:
    h = hashlib.sha256("\n".join(sig for _, _, sig in entries).encode()).hexdigest()[:16]
    return f"{h}:{len(entries)}"


def holders_of(key: str) -> Tuple[int, ...]:
    """The ranks that must list `key`: a group's members, a channel's two ends."""
    if key.startswith(CHANNEL):
        src, dst = key[len(CHANNEL):].split("->")
        return int(src), int(dst)
    return parse_ranks(key[len(GROUP):])


def first_disagreement(everyone: Dict[int, Dict[str, str]]) -> Optional[Tuple[str, int, int]]:
    """(key, odd rank, reference rank) of the first key, in sorted order, whose holders'
    digests differ (a holder without it counts as issuing none); None when all agree.
    Every rank given the same digests finds the same answer."""
    keys = sorted({k for digests in everyone.values() for k in digests})
    for key in keys:
        got = {r: everyone.get(r, {}).get(key) for r in holders_of(key)}
        votes = Counter(got.values())
        if len(votes) == 1:
            continue
        # the reference: the digest most holders have (a present one before none), lowest rank
        ref = min(got, key=lambda r: (-votes[got[r]], got[r] is None, r))
        odd = min(r for r in got if got[r] != got[ref])
        return key, odd, ref
    return None


def explain(key: str, odd: int, ref: int, odd_seq: Sequence[Entry], ref_seq: Sequence[Entry]) -> str:
    """Where two ranks' sequences for `key` part: the first instruction, by plan index."""
    k = next((k for k in range(max(len(odd_seq), len(ref_seq)))
              if k >= len(odd_seq) or k >= len(ref_seq) or odd_seq[k][2] != ref_seq[k][2]), None)
    if k is None:   # equal signatures, other digests: cannot happen unless a rank's plan changed
        return f"{key}: ranks {odd} and {ref} list the same {len(odd_seq)} instruction(s)"

    def at(seq, rank):
        if k >= len(seq):
            return f"rank {rank} lists no #{k} there ({len(seq)} in all)"
        return f"rank {rank} lists `{seq[k][1]}` (instruction #{seq[k][0]} of its plan)"
    what = "collective" if key.startswith(GROUP) else "transfer"
    return (f"{what} #{k} of the {key}: {at(odd_seq, odd)}, but {at(ref_seq, ref)}"
            + (" as do the other members" if key.startswith(GROUP) and len(holders_of(key)) > 2 else ""))
