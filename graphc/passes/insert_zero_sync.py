"""insert_zero_sync: ZeRO's gradient reduce-scatters and parameter all-gathers.

Invariant: with config.enable_zero (stage 1 or 2), in every training plan, each parameter
that is sharded (See NOTE: ZeRO in graphc/runtime/zero.py: its gradient is partial_sum on one
or more mesh axes, one stage holds it, and its local component has a dim 0 and at least
`min_size` elements) is named by no ALL_REDUCE. Its gradient is reduced by a REDUCE_SCATTER
over the joint group of those axes instead (one axis's group, or the flattened group of
several: See NOTE: ZeRO over joint axes), in buckets of at most `bucket_bytes` in backward
order (as insert_grad_sync's, and before them: the replicated ones are small), and the same
bucket is all-gathered by an ALL_GATHER over that group right after the optimizer step. Every
other gradient is all-reduced as insert_grad_sync left it. A REDUCE_SCATTER's gradients are in
the dtype insert_grad_sync gave them (config.set_grad_reduce_dtype), an ALL_GATHER's
parameters in their own. The plan's zero note lists each group: its ranks, the axes joined,
its share of the optimizer state and the gradient bytes it reduce-scatters.
At stage 3 no ALL_GATHER follows the step: each stage's sharded parameters are gathered by an
ALL_GATHER before the compute that reads them and freed by a RELEASE after it, once per step
(before the stage's first compute, freed after its last) on a rank that holds one stage, per
compute on a rank that holds several (See NOTE: ZeRO stage 3 in graphc/runtime/zero.py).
Requires: insert_grad_sync.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch.fx as fx

from ..meta import META_GRAD_PARTIAL, META_SBP, META_STAGE, META_TENSOR
from ..plan.instructions import (COMPUTE, AllGather, AllReduce, OptimizerStep, OverlapFB, ReduceScatter,
                                 ReleaseParams, TensorSpec)
from ..plan.plan import ZERO_NOTE, ExecutionPlan
from ..sbp.layout import joint_groups
from .insert_grad_sync import _buckets


def insert_zero_sync(plans: Sequence[ExecutionPlan], gm: fx.GraphModule, stage: int,
                     min_size: int, bucket_bytes: int) -> List[ExecutionPlan]:
    if not stage:
        return list(plans)
    shardable = _shardable(gm)
    dtypes = {str(n.target): n.meta[META_TENSOR].dtype for n in gm.graph.nodes
              if n.op == "get_attr" and str(n.target) in shardable and n.meta.get(META_TENSOR)}
    made: Dict[tuple, _Rewrite] = {}
    group_of = list({id(s.group_of): s.group_of for s in shardable.values()}.values())   # a few
    for plan in plans:
        if plan.training:
            groups = tuple(g.get(plan.rank) for g in group_of)
            _shard(plan, stage, shardable, min_size, bucket_bytes, dtypes, made, groups)
    return list(plans)


@dataclass(frozen=True)
class _Shardable:
    """A parameter ZeRO may shard: the stage holding it, the mesh axes its gradient is summed
    over, and each rank's group over them (their joint group: See NOTE: ZeRO over joint axes in
    graphc/runtime/zero.py), in backward order (`order`, as insert_grad_sync buckets)."""

    stage: int
    axes: Tuple[int, ...]
    group_of: Dict[int, Tuple[int, ...]]   # rank -> its group (one dict per mesh and axes)
    order: int


def _shardable(gm: fx.GraphModule) -> Dict[str, _Shardable]:
    """The parameters whose gradient is partial on one or more mesh axes, held by one stage:
    name -> where and over which ranks it may be sharded."""
    stages: Dict[int, Set[int]] = defaultdict(set)
    names: Dict[int, Set[str]] = defaultdict(set)
    summed: Dict[str, Tuple[tuple, Tuple[int, ...]]] = {}   # name -> (mesh, axes)
    for node in reversed(list(gm.graph.nodes)):    # backward order: last used first
        if node.op != "get_attr":
            continue
        try:
            p = gm.get_parameter(str(node.target))
        except AttributeError:   # a buffer
            continue
        stages[id(p)].add(node.meta.get(META_STAGE))
        names[id(p)].add(str(node.target))
        axes = tuple(sorted(node.meta.get(META_GRAD_PARTIAL, ())))
        if axes:
            summed.setdefault(str(node.target), (node.meta[META_SBP].mesh, axes))
    groups: Dict[Tuple[tuple, Tuple[int, ...]], Dict[int, Tuple[int, ...]]] = {}
    for key in set(summed.values()):
        groups[key] = {r: g for g in joint_groups(*key) for r in g}
    order = {n: i for i, n in enumerate(summed)}
    # a tied parameter (held by several stages) is summed over them after its data-parallel
    # all-reduce (insert_tie_sync): it stays whole
    return {n: _Shardable(next(iter(stages[key])), summed[n][1], groups[summed[n]], order[n])
            for key, ns in names.items() if len(stages[key]) == 1 for n in ns if n in summed}


@dataclass(frozen=True)
class _Rewrite:
    """What ZeRO makes of one rank's gradient ALL_REDUCEs, the same for every rank whose
    ALL_REDUCEs name the same groups and gradients (made once for them: their plans share the
    instructions, as list_collectives shares a group's)."""

    kept: Tuple[Optional[AllReduce], ...]      # per ALL_REDUCE: what stays of it, or None
    scatters: Tuple[ReduceScatter, ...]        # the buckets, where the first ALL_REDUCE was
    gathers: Tuple[AllGather, ...]             # stages 1 and 2: after the optimizer step
    in_order: Dict[Tuple[int, ...], List[TensorSpec]]   # group -> its sharded gradients
    note: str


def _shard(plan: ExecutionPlan, stage: int, shardable: Dict[str, _Shardable], min_size: int,
           bucket_bytes: int, dtypes: Dict[str, str], made: Dict[tuple, _Rewrite], groups: tuple) -> None:
    """`groups`: this rank's group for each mesh and set of axes: with its ALL_REDUCEs, what
    the rewrite depends on."""
    reduces = [ins for ins in plan.instructions if type(ins) is AllReduce]
    key = (groups, tuple((ins.ranks, tuple(map(id, ins.tensors))) for ins in reduces))
    rewrite = made.get(key)
    if rewrite is None:
        rewrite = made[key] = _rewrite(reduces, plan.rank, stage, shardable, min_size, bucket_bytes, dtypes)
    if not rewrite.scatters:
        return
    out, k = [], 0
    for ins in plan.instructions:
        if type(ins) is not AllReduce:
            out.append(ins)
            continue
        if k == 0:
            out.extend(rewrite.scatters)
        if rewrite.kept[k] is not None:
            out.append(rewrite.kept[k])
        k += 1
    when = ""
    if stage == 3:
        out, when = _gather_for_use(out, plan, rewrite.in_order, shardable, dtypes)
    else:
        step = next(i for i, ins in enumerate(out) if isinstance(ins, OptimizerStep))
        out[step + 1:step + 1] = rewrite.gathers
    plan.instructions[:] = out
    # the runtime reads the stage here (zero.py: stage 1 keeps its gradient buckets)
    plan.notes[ZERO_NOTE] = f"stage {stage}; {rewrite.note}{when}"


def _rewrite(reduces: List[AllReduce], rank: int, stage: int, shardable: Dict[str, _Shardable],
             min_size: int, bucket_bytes: int, dtypes: Dict[str, str]) -> _Rewrite:
    # group -> name -> spec: a gradient summed over two axes is in two ALL_REDUCEs, once each
    scatter: Dict[Tuple[int, ...], Dict[str, TensorSpec]] = defaultdict(dict)
    kept = []
    for ins in reduces:
        keep = []
        for t in ins.tensors:
            if _sharded(t, shardable, min_size):
                scatter[shardable[t.name].group_of[rank]].setdefault(t.name, t)
            else:
                keep.append(t)
        kept.append(AllReduce(ins.ranks, tuple(keep)) if keep else None)
    # every rank of a group lists its buckets alike: groups, then parameters, in backward order
    in_order = {group: sorted(specs.values(), key=lambda t: shardable[t.name].order)
                for group, specs in sorted(scatter.items(), key=lambda gs: min(
                    shardable[n].order for n in gs[1]))}
    buckets = [(group, tuple(b)) for group, specs in in_order.items() for b in _buckets(specs, bucket_bytes)]
    gathers = () if stage == 3 else tuple(
        AllGather(group, tuple(replace(t, dtype=dtypes.get(t.name, t.dtype)) for t in b)) for group, b in buckets)
    whole = len({t.name for ins in kept if ins is not None for t in ins.tensors})
    groups = "; ".join(_group_note(group, specs, shardable) for group, specs in in_order.items())
    return _Rewrite(tuple(kept), tuple(ReduceScatter(group, b) for group, b in buckets), gathers, in_order,
                    f"{groups}; {whole} whole (fewer than {min_size} elements, or tied)")


def _group_note(group: Tuple[int, ...], specs: List[TensorSpec], shardable: Dict[str, _Shardable]) -> str:
    """How one group shards: its ranks, the mesh axes joined, its share of the optimizer
    state, and the gradient bytes it reduce-scatters a step (padded to equal parts)."""
    axes = sorted({a for t in specs for a in shardable[t.name].axes})
    nbytes = ReduceScatter(group, tuple(specs)).padded_nbytes
    return (f"{len(specs)} parameter(s) split(0) over ranks {list(group)} (mesh "
            f"ax{'es' if len(axes) > 1 else 'is'} {' x '.join(map(str, axes))}: 1/{len(group)} of "
            f"their optimizer state a rank; {nbytes} B of gradients reduce-scattered a step)")


def _gather_for_use(out: list, plan: ExecutionPlan, scatter: Dict[Tuple[int, ...], List[TensorSpec]],
                    shardable: Dict[str, _Shardable], dtypes: Dict[str, str]) -> Tuple[list, str]:
    """Stage 3: each stage's sharded parameters gathered before the computes that read them
    and released after. A rank holding one stage gathers once per step (whole from the
    stage's first compute to its last: memory for bytes); a rank holding several gathers per
    compute, so one chunk at a time is whole (bytes for memory)."""
    by_stage: Dict[int, Dict[Tuple[int, ...], List[TensorSpec]]] = defaultdict(lambda: defaultdict(list))
    for group, specs in scatter.items():
        for t in specs:
            by_stage[shardable[t.name].stage][group].append(replace(t, dtype=dtypes.get(t.name, t.dtype)))
    per_compute = len(plan.local_stages) > 1
    uses: Dict[int, List[int]] = defaultdict(list)    # stage -> positions of its computes
    for i, ins in enumerate(out):
        if isinstance(ins, COMPUTE):
            for s in _stages_of(ins):
                if s in by_stage:
                    uses[s].append(i)
    before: Dict[int, list] = defaultdict(list)
    after: Dict[int, list] = defaultdict(list)
    for s, at in uses.items():
        gathers = [AllGather(g, tuple(specs)) for g, specs in by_stage[s].items()]
        release = ReleaseParams(tuple(t for specs in by_stage[s].values() for t in specs))
        for i in (at if per_compute else at[:1]):
            before[i].extend(gathers)
        for i in (at if per_compute else at[-1:]):
            after[i].append(release)
    done = []
    for i, ins in enumerate(out):
        done.extend(before.get(i, ()))
        done.append(ins)
        done.extend(after.get(i, ()))
    how = "per compute (several chunks here)" if per_compute else "once per step"
    return done, f"; parameters gathered before use and released after, {how}"


def _stages_of(ins) -> Tuple[int, ...]:
    if isinstance(ins, OverlapFB):
        return (ins.forward.stage, ins.backward.stage)
    return (ins.stage,)


def _sharded(t: TensorSpec, shardable: Dict[str, _Shardable], min_size: int) -> bool:
    numel = 1
    for d in t.shape:
        numel *= d
    return t.name in shardable and len(t.shape) >= 1 and numel >= min_size
