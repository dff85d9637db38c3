"""insert_tie_sync: sums a tied parameter's gradient over every stage that holds it.

Invariant: in a training plan, for every parameter that several stage programs hold (an
embedding tied to the LM head, one module called on two stages), replica k of each of
those stages issues, after its gradient all-reduces and before its optimizer step, one
TieAllReduce over {replica k of every holding stage}, covering all the parameters tied
among those stages. Each holder then steps on the same summed gradient. A tie split over
its stages' meshes (a vocabulary-parallel embedding and head) sums replica k's shard
with replica k's: the stages have one mesh shape and the parameter one layout.
Requires: split_stages, lower_plan, insert_grad_sync (a data-parallel stage reduces over
its replicas first; the tie then sums whole stage gradients).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import GraphcError
from ..meta import META_SBP, META_TENSOR
from ..plan.instructions import OptimizerStep, TensorSpec, TieAllReduce
from ..plan.plan import ExecutionPlan, StageInfo
from ..plan.program import StageProgram
from ..sbp.layout import local_shape
from .insert_grad_sync import held_in

# NOTE: Tied parameters
# graphc keeps one copy of a parameter per stage that uses it: annotate_stages gives each
# stage its own read of it (and each call of a shared module its caller's stage), so the
# stage programs hold it instead of receiving it every micro-batch. Eager autograd sums
# the gradients of all uses into one .grad; here each copy gets its own stage's part, and
# insert_tie_sync adds them with one all-reduce among the holders (DeepSpeed's tied
# layers, Megatron's embedding group). All holders then run the same optimizer update on
# the same gradient from the same state, so the copies stay bit-identical, and any of
# them is the trained value (GraphState takes the first holder's for full_state_dict).


def insert_tie_sync(plans: Sequence[ExecutionPlan], programs: Sequence[StageProgram],
                    stages: Sequence[StageInfo], grad_dtype: Optional[torch.dtype] = None
                    ) -> List[ExecutionPlan]:
    per_rank: Dict[int, List[TieAllReduce]] = defaultdict(list)
    for holders, tied in _ties(programs, stages, grad_dtype).items():
        _check_sizes(holders, tied, stages)
        for k in range(len(stages[holders[0]].ranks)):
            specs = tuple(spec[k] for spec, _ in tied)  # replica k's shards (uneven splits)
            # two holding chunks on one rank share the parameter object (and its .grad): the
            # rank takes part once, and a tie held by one rank's chunks only needs no sum
            by_rank = {}
            for s in holders:
                by_rank.setdefault(stages[s].ranks[k], s)
            if len(by_rank) < 2:
                continue
            group = tuple(sorted(by_rank))
            for r, s in by_rank.items():
                names = tuple(local[s] for _, local in tied)
                per_rank[r].append(TieAllReduce(group, specs, names))
    for plan in plans:
        if plan.training and per_rank.get(plan.rank):
            at = next(i for i, ins in enumerate(plan.instructions) if isinstance(ins, OptimizerStep))
            plan.instructions[at:at] = per_rank[plan.rank]
    return list(plans)


def _ties(programs: Sequence[StageProgram], stages: Sequence[StageInfo],
          grad_dtype: Optional[torch.dtype] = None) -> Dict[Tuple[int, ...], List[Tuple[Tuple[TensorSpec, ...], Dict[int, str]]]]:
    """holding stages -> [(spec per replica under the parameter's first name, stage -> its
    local name)]."""
    first: Dict[int, Tuple[tuple, Dict[int, str]]] = {}   # parameter -> (its first reader, stage -> name)
    for prog in programs:
        for name, p in prog.module.named_parameters():
            if not p.requires_grad:
                continue
            reader, local = first.setdefault(id(p), ((prog, name, p), {}))
            local.setdefault(prog.stage, name)
    out: Dict[Tuple[int, ...], List[Tuple[Tuple[TensorSpec, ...], Dict[int, str]]]] = defaultdict(list)
    for (prog, name, p), local in first.values():
        if len(local) > 1:   # tied: its specs (one per replica, a stage's ranks many) made only then
            out[tuple(sorted(local))].append((_spec(prog, name, p, stages[prog.stage].ranks, grad_dtype), local))
    return dict(out)


def _spec(prog: StageProgram, name: str, p: torch.Tensor, ranks,
          grad_dtype: Optional[torch.dtype] = None) -> Tuple[TensorSpec, ...]:
    """The gradient replica k (on ranks[k]) sums: a split (vocabulary-parallel) tie sums shard
    with shard, in that replica's shape (NOTE: Uneven splits, docs/sbp.md)."""
    read = next((n for n in prog.module.graph.nodes if n.op == "get_attr" and n.target == name
                 and META_SBP in n.meta), None)
    dtype = held_in(str(p.dtype).replace("torch.", ""), grad_dtype)   # summed in float32 (a master's)
    if read is None:
        return tuple(TensorSpec(name, tuple(p.shape), dtype) for _ in ranks)
    meta, sig = read.meta[META_TENSOR], read.meta[META_SBP]
    return tuple(TensorSpec(name, local_shape(meta.shape, sig.out, sig.mesh, r), dtype) for r in ranks)


def _check_sizes(holders: Tuple[int, ...], tied, stages: Sequence[StageInfo]) -> None:
    sizes = {s: len(stages[s].ranks) for s in holders}
    if len(set(sizes.values())) > 1:
        names = [spec[0].name for spec, _ in tied]
        raise GraphcError(
            f"parameter(s) {names} are used on stages {list(holders)}, which run on "
            f"{[sizes[s] for s in holders]} ranks; a parameter shared by several stages "
            "(tied) is summed replica by replica, which needs the same number of ranks on "
            "each of those stages. Fix: give the stages that share it placements of equal "
            "size, or keep the modules that share it in one stage.")
