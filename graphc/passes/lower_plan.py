"""lower_plan: turns stage programs and a schedule into one ExecutionPlan per rank.

Invariant: rank r's plan lists, in issue order, its stage's compute in schedule order,
each forward preceded by a recv of every value it reads from another stage and followed
by a send of every value another stage reads, each backward likewise for gradients,
and one optimizer step at the end of a training step. Replica k of a stage talks to
replica k of another stage.
Requires: split_stages; stages with equal rank counts wherever they exchange values.
"""
from __future__ import annotations

from typing import List, Sequence

from ..errors import GraphcError
from ..plan.instructions import ACT, GRAD, Backward, Forward, Instruction, OptimizerStep, Recv, Send
from ..plan.plan import ExecutionPlan, StageInfo
from ..plan.program import StageProgram
from ..plan.schedules import compute_order


def lower_plan(programs: Sequence[StageProgram], stages: Sequence[StageInfo], schedule: str,
               num_microbatches: int, training: bool, world_size: int) -> List[ExecutionPlan]:
    _check_pairable(programs, stages)
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


def _peer(stages: Sequence[StageInfo], rank: int, mine: int, other: int) -> int:
    """The replica of stage `other` that replica k of stage `mine` talks to."""
    return stages[other].ranks[stages[mine].ranks.index(rank)]


def _with_p2p(order, programs, stages, rank) -> List[Instruction]:
    out: List[Instruction] = []
    for ins in order:
        s, mb = ins.stage, ins.microbatch
        prog = programs[s]
        if isinstance(ins, Forward):
            for a, specs in sorted(prog.recv_from.items()):
                out.append(Recv(s, mb, _peer(stages, rank, s, a), ACT, a, tuple(specs)))
            out.append(ins)
            for b, specs in sorted(prog.send_to.items()):
                out.append(Send(s, mb, _peer(stages, rank, s, b), ACT, b, tuple(specs)))
        elif isinstance(ins, Backward):
            for b, specs in sorted(prog.send_to.items()):
                grads = tuple(prog.grad_specs(specs))
                if grads:
                    out.append(Recv(s, mb, _peer(stages, rank, s, b), GRAD, b, grads))
            out.append(ins)
            for a, specs in sorted(prog.recv_from.items()):
                grads = tuple(prog.grad_specs(specs))
                if grads:
                    out.append(Send(s, mb, _peer(stages, rank, s, a), GRAD, a, grads))
        else:
            out.append(ins)
    return out


def _check_pairable(programs, stages) -> None:
    for prog in programs:
        for b in prog.send_to:
            na, nb = len(stages[prog.stage].ranks), len(stages[b].ranks)
            if na != nb:
                raise GraphcError(
                    f"stage {prog.stage} (ranks {list(stages[prog.stage].ranks)}) sends "
                    f"{[t.name for t in prog.send_to[b]]} to stage {b} (ranks "
                    f"{list(stages[b].ranks)}): pipeline stages exchanging values need the same "
                    "number of ranks. Fix: give both stages placements of equal size.")
