"""insert_grad_clip: gradient clipping by the global norm, as eager's clip_grad_norm_.

Invariant: with config.set_grad_clip_norm(max_norm), every rank that runs a stage of a
training plan issues one ClipGradNorm right before its optimizer step (after every
gradient all-reduce), over the same ranks (every rank that runs a stage). Its `params`
name the gradients this rank adds to the squared norm, so that over all ranks every
parameter's gradient is counted exactly once: a replicated parameter (broadcast on a mesh
axis) by the rank at index 0 of that axis (a ZeRO one, reduce-scattered, by every rank: its
rows), each shard of a split parameter by a rank
holding it, a parameter used by several stages (tied) by its first stage.
Requires: split_stages, infer_sbp (parameters' layouts), insert_grad_sync (the clip
follows the gradient all-reduces that make replicas equal).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..meta import META_SBP
from ..placement import Broadcast, Split
from ..plan.instructions import ClipGradNorm, OptimizerStep, ReduceScatter, TensorSpec
from ..plan.plan import ExecutionPlan
from ..plan.program import StageProgram
from ..sbp.declared import DeclaredLayouts
from ..sbp.layout import coord, flat, mesh_shape
from .insert_grad_sync import held_in


def insert_grad_clip(plans: Sequence[ExecutionPlan], programs: Sequence[StageProgram],
                     meshes: Sequence[tuple], max_norm: Optional[float],
                     declared: DeclaredLayouts = DeclaredLayouts(),
                     grad_dtype: Optional[torch.dtype] = None) -> List[ExecutionPlan]:
    if max_norm is None or not any(p.training for p in plans):
        return list(plans)
    counted = _counted_params(programs, meshes, declared)
    ranks = tuple(sorted({r for mesh in meshes[:len(programs)] for r in flat(mesh)}))
    dtype = held_in(_grad_dtype(programs), grad_dtype)   # a master's gradient: float32
    for plan in plans:
        if not plan.training or plan.rank not in ranks:
            continue
        clip = ClipGradNorm(ranks, (TensorSpec("grad_norm_sq", (), dtype),), max_norm,
                            _with_shards(counted.get(plan.rank, ()), plan))
        at = next(i for i, ins in enumerate(plan.instructions) if isinstance(ins, OptimizerStep))
        plan.instructions.insert(at, clip)
    return list(plans)


def _counted_params(programs: Sequence[StageProgram], meshes: Sequence[tuple],
                    declared: DeclaredLayouts) -> Dict[int, List[str]]:
    """rank -> names (in its stage program) of the parameters whose gradients it counts."""
    out: Dict[int, List[str]] = {}
    seen: Set[int] = set()  # a tied parameter: counted by the first stage that holds it
    for prog in programs:
        mesh = meshes[prog.stage]
        layouts = {n.target: n.meta[META_SBP] for n in prog.module.graph.nodes
                   if n.op == "get_attr" and META_SBP in n.meta}
        for name, p in prog.module.named_parameters():
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            sbp = layouts[name].out if name in layouts else _declared_sbp(declared.of(name), mesh)
            for r in flat(mesh):
                # one copy of each shard: index 0 on every axis where the parameter is whole
                if all(c == 0 for c, s in zip(coord(mesh, r), sbp) if not isinstance(s, Split)):
                    out.setdefault(r, []).append(name)
    return out


def _with_shards(names: Sequence[str], plan: ExecutionPlan) -> Tuple[str, ...]:
    """`names`, and every parameter the plan reduce-scatters: a ZeRO parameter's gradient is
    split over its group, each rank counts its rows (See NOTE: ZeRO in runtime/zero.py)."""
    sharded = [t.name for ins in plan.instructions if isinstance(ins, ReduceScatter) for t in ins.tensors]
    return tuple(dict.fromkeys(list(names) + sharded))


def _declared_sbp(layout, mesh: tuple) -> tuple:
    """A parameter read inside a module kept whole: its to_global layout, else broadcast."""
    axes = len(mesh_shape(mesh))
    if layout is not None and len(layout.sbp) == axes:
        return layout.sbp
    return (Broadcast(),) * axes


def _grad_dtype(programs: Sequence[StageProgram]) -> str:
    for prog in programs:
        for p in prog.module.parameters():
            if p.is_floating_point():
                return str(p.dtype).replace("torch.", "")
    return "float32"
