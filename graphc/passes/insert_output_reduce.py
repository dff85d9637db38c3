"""insert_output_reduce: build()'s partial_sum results summed once per step, off the critical path.

Invariant: every rank of the stage that makes a partial_sum result of build() (a loss under
data parallelism: each rank's mean over its rows is an addend of the batch's) lists, right
after its last compute of that stage in the step, one OutputAllReduce per partial mesh axis
and dtype over this rank's group of that axis. Its tensors hold every micro-batch's value,
one row each (shape `[m, *local shape]`), so the runtime sums them all in one all-reduce,
launched there without waiting and finished when the step ends; the micro-batches' sums
then merge as before (a batch mean is averaged), so the value is the one a per-micro-batch
reduction gave, bit for bit. The stage programs leave such results partial (insert_boxing).
Requires: infer_sbp, lower_plan; before list_collectives (it lists after each compute, so
this instruction follows a compute's collectives).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

import torch.fx as fx

from ..meta import META_SBP, META_STAGE, META_TENSOR
from ..placement import PartialSum
from ..plan.instructions import COMPUTE, UNIT_EVENTS, Collective, OutputAllReduce, TensorSpec
from ..plan.plan import ExecutionPlan
from ..sbp.layout import axis_groups, local_shape


def insert_output_reduce(plans: Sequence[ExecutionPlan], gm: fx.GraphModule) -> List[ExecutionPlan]:
    partial = partial_outputs(gm)
    for plan in plans:
        for stage, nodes in partial.items():
            if stage in plan.local_stages:
                at = _after_last_compute(plan, stage)
                plan.instructions[at:at] = _reductions(nodes, plan.rank, plan.num_microbatches)
    return list(plans)


def partial_outputs(gm: fx.GraphModule) -> Dict[int, List[fx.Node]]:
    """stage -> build()'s results that are partial_sum on some mesh axis, in output order."""
    found: Dict[int, List[fx.Node]] = defaultdict(list)
    for node in gm.graph.output_node().all_input_nodes:
        sig = node.meta.get(META_SBP)
        if sig is not None and any(isinstance(s, PartialSum) for s in sig.out):
            found[node.meta[META_STAGE]].append(node)
    return found


def _reductions(nodes: List[fx.Node], rank: int, m: int) -> List[OutputAllReduce]:
    """One instruction per (mesh axis, dtype): each axis's sum follows the one before."""
    per_key: Dict[Tuple[int, Tuple[int, ...], str], List[TensorSpec]] = defaultdict(list)
    for node in nodes:
        sig, meta = node.meta[META_SBP], node.meta[META_TENSOR]
        dtype = meta.dtype
        rows = (m,) + tuple(local_shape(meta.shape, sig.out, sig.mesh, rank))
        for axis, s in enumerate(sig.out):
            if isinstance(s, PartialSum):
                group = next(g for g in axis_groups(sig.mesh, axis) if rank in g)
                per_key[(axis, group, dtype)].append(TensorSpec(node.name, rows, dtype))
    return [OutputAllReduce(group, tuple(specs)) for (_, group, _), specs in sorted(per_key.items())]


def _after_last_compute(plan: ExecutionPlan, stage: int) -> int:
    """The index just past this rank's last compute of `stage` and what is listed with it."""
    last = max(i for i, ins in enumerate(plan.instructions) if isinstance(ins, COMPUTE) and _runs(ins, stage))
    at = last + 1
    while at < len(plan.instructions) and isinstance(plan.instructions[at], (Collective,) + UNIT_EVENTS):
        at += 1
    return at


def _runs(ins, stage: int) -> bool:
    return any(p.stage == stage for p in ins.parts)
