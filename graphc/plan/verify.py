"""Verifies a set of per-rank plans before anything runs.

Every rank can compute every rank's plan, so one process checks that:
  1. each send meets a recv on its peer, in the same order, with equal payload specs
     (shapes and dtypes: the receiver's buffer is made from its own spec);
  2. each collective the plans list (gradient bucket, tie or clip all-reduce, the boxing
     collectives list_collectives adds) is issued by exactly its ranks: each rank's k-th
     collective over a group has the same kind, ranks, tensors (shapes, dtypes) or
     conversion and dtype as every other member's k-th (a differing dtype is named as such:
     the members would exchange buffers of other sizes and types; verify_collectives.py).
     A prologue's sum (feed_whole_batch), which the runtime runs before a step's
     instructions, is not listed and not checked here; a pre-pass's (PrePass, NOTE:
     Whole-batch sums) transfers and collectives are, like the step's;
  3. the union of all plans, with sends joined to their recvs and collectives joined
     across ranks, is acyclic (so no rank can wait forever on another); a cycle is
     printed rank by rank (verify_deadlock.py);
  4. each rank computes every (stage, micro-batch) it starts as a program: one forward,
     then one backward, whole (B) or split into I and, after it, W; in training, all of it;
     a stage's pre-pass (P) comes before its first forward;
  5. under ZeRO, each sharded gradient is reduce-scattered once, over one group, all-reduced
     by nothing else, and its rows gathered over that group (verify_zero.py).
A failure raises PlanError naming the rank and instruction, with the plan listing marked
(verify_failures.py).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

from .instructions import (COMPUTE_RUNS, STAGE_COMPUTES, Backward, BackwardInput, BackwardWeight,
                           Forward, Instruction, PrePass, Recv, Send)
from .plan import ExecutionPlan
from .verify_collectives import is_collective, pair_collectives, signature
from .verify_deadlock import check_acyclic
from .verify_failures import dtype_clash, fail
from .verify_zero import check_zero_groups

__all__ = ["verify_plans", "is_collective", "signature"]   # the checks' parts have files of their own


def verify_plans(plans: Sequence[ExecutionPlan], world_size: Optional[int] = None,
                 quotient: bool = False) -> None:
    """Raises PlanError if the plans cannot run together to completion.

    world_size: the job's ranks, when `plans` are only some of them (a rank's own compile,
    NOTE: Plans of some ranks): then each plan's compute order is checked (4) and its peers
    lie in the world; pairing (1, 2) is checked at startup between the ranks themselves
    (runtime/agreement.py; NOTE: Plan digests), and deadlock freedom (3) by `graphc plan`.
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
        check_zero_groups(plan, fail, zero_checked)
    if world_size is not None and len(by_rank) < world_size and not quotient:
        for plan in plans:
            _check_peers_in_world(plan, world_size)
        return
    pairs = _pair_p2p(by_rank)
    groups = pair_collectives(by_rank, world_size if quotient else None)
    check_acyclic(by_rank, pairs, groups)


def _check_peers_in_world(plan: ExecutionPlan, world_size: int) -> None:
    for i, ins in enumerate(plan.instructions):
        peers = [ins.peer] if ins.runs in (Send.runs, Recv.runs) else \
            list(ins.ranks) if is_collective(ins) else []
        outside = [r for r in peers if not 0 <= r < world_size]
        if outside:
            fail(plan, i, f"rank(s) {outside} are outside the world of {world_size} ranks")
        if is_collective(ins) and plan.rank not in ins.ranks:
            fail(plan, i, f"rank {plan.rank} issues a collective over ranks {list(ins.ranks)} "
                  "that it is not part of")


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
                fail(plan, i, f"`{part}` comes after a forward of stage {part.stage}: a stage's "
                      "pre-pass (NOTE: Whole-batch sums) gives every micro-batch's forward its totals, "
                      "so lower_plan lists it before the schedule")
            if type(part) not in STAGE_COMPUTES:
                continue
            if type(part) is Forward:
                forwarded.add(part.stage)
            key, step = (part.stage, part.microbatch), part.letter
            done = seen.get(key, "")
            if not any(prog.startswith(done + step) for prog in _PROGRAMS):
                fail(plan, i, _misordered(part, done, step, plan.schedule))
            seen[key], last[key] = done + step, i
    for key, done in seen.items():
        if plan.training and done not in _PROGRAMS:
            missing = "B (or I and W)" if done == "F" else "W"
            fail(plan, last[key], f"stage {key[0]} micro-batch {key[1]} ran {'+'.join(done)} "
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
                    fail(plan, i, f"peer rank {ins.peer} is outside the world of {len(by_rank)} ranks")
                queues[(rank, ins.peer)]["send"].append((i, ins))
            elif ins.runs == Recv.runs:
                if ins.peer not in by_rank:
                    fail(plan, i, f"peer rank {ins.peer} is outside the world of {len(by_rank)} ranks")
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
                    fail(by_rank[dst], j, f"{dtype_clash(s.tensors, r.tensors) or 'payload'} "
                          f"mismatch with rank {src} #{i}: sent [{' '.join(map(str, s.tensors))}], "
                          f"expected [{' '.join(map(str, r.tensors))}]")
                pairs.append(((src, i), (dst, j)))
                continue
            counts = f"rank {src} sends {len(sends)} to rank {dst}, which posts {len(recvs)} recvs"
            if len(sends) > len(recvs):
                fail(by_rank[src], sends[k][0], f"no matching recv on rank {dst} ({counts})")
            if len(recvs) > len(sends):
                fail(by_rank[dst], recvs[k][0], f"no matching send on rank {src} ({counts})")
            (i, s), (j, r) = sends[k], recvs[k]
            fail(by_rank[dst], j, f"out of order: the {k}-th transfer from rank {src} is "
                  f"`{s}` (rank {src} #{i}) but rank {dst} expects `{r}`")
    return pairs


def _same_transfer(s: Send, r: Recv) -> bool:
    return (s.microbatch == r.microbatch and s.direction == r.direction
            and s.stage == r.peer_stage and s.peer_stage == r.stage)
