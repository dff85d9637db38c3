"""lower_plan: turns stage programs and a schedule into one ExecutionPlan per rank.

Invariant: rank r's plan lists, in issue order, its stage's compute in schedule order,
each forward preceded by a recv of every value it reads from another stage and followed
by a send of every value another stage reads, each backward likewise for gradients,
and one optimizer step at the end of a training step. Replica k of a stage talks to
replica k of another stage; between stages of n and m ranks (n-to-m), rank j of the
receiving stage gets each value from replica j mod n of the sender, and sender i gets its
gradient back from replica i mod m (the value is broadcast then, see insert_boxing).
Requires: split_stages.
"""
from __future__ import annotations

from typing import List, Sequence

from ..plan.instructions import ACT, GRAD, Backward, Forward, Instruction, OptimizerStep, Recv, Send
from ..plan.plan import ExecutionPlan, StageInfo
from ..plan.program import StageProgram
from ..plan.schedules import compute_order


def lower_plan(programs: Sequence[StageProgram], stages: Sequence[StageInfo], schedule: str,
               num_microbatches: int, training: bool, world_size: int) -> List[ExecutionPlan]:
    stage_of_rank = {r: s.stage_id for s in stages for r in s.ranks}
    plans = []
    for rank in range(world_size):
        instrs: List[Instruction] = []
        if rank in stage_of_rank:
            s = stage_of_rank[rank]
            order = compute_order(schedule, s, len(stages), num_microbatches, training)
            instrs = _with_p2p(order, programs, stages, rank)
        if training:
            instrs.append(OptimizerStep())
        plans.append(ExecutionPlan(rank, world_size, instrs, num_microbatches, schedule,
                                   tuple(stages), training))
    return plans


def _source(stages: Sequence[StageInfo], rank: int, mine: int, other: int) -> int:
    """The replica of stage `other` that replica k of stage `mine` receives from."""
    theirs = stages[other].ranks
    return theirs[stages[mine].ranks.index(rank) % len(theirs)]


def _targets(stages: Sequence[StageInfo], rank: int, mine: int, other: int) -> List[int]:
    """The replicas of stage `other` that receive from replica k of stage `mine`."""
    k, n = stages[mine].ranks.index(rank), len(stages[mine].ranks)
    return [r for j, r in enumerate(stages[other].ranks) if j % n == k]


def _with_p2p(order, programs, stages, rank) -> List[Instruction]:
    out: List[Instruction] = []
    for ins in order:
        s, mb = ins.stage, ins.microbatch
        prog = programs[s]
        if isinstance(ins, Forward):
            for a, specs in sorted(prog.recv_from.items()):
                out.append(Recv(s, mb, _source(stages, rank, s, a), ACT, a, tuple(specs)))
            out.append(ins)
            for b, specs in sorted(prog.send_to.items()):
                out += [Send(s, mb, peer, ACT, b, tuple(specs)) for peer in _targets(stages, rank, s, b)]
        elif isinstance(ins, Backward):
            for b, specs in sorted(prog.send_to.items()):
                grads = tuple(prog.grad_specs(specs))
                if grads:
                    out.append(Recv(s, mb, _source(stages, rank, s, b), GRAD, b, grads))
            out.append(ins)
            for a, specs in sorted(prog.recv_from.items()):
                grads = tuple(prog.grad_specs(specs))
                if grads:
                    out += [Send(s, mb, peer, GRAD, a, grads) for peer in _targets(stages, rank, s, a)]
        else:
            out.append(ins)
    return out

