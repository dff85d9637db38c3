"""find_plan_symmetry: the rows of replicas a whole-world lowering may stand for by renaming.

Invariant: returns a RowSymmetry only when every rank of row d lowers to its row-0 template
renamed (NOTE: Plan templates, (A)): the stages' meshes are pairwise equal or disjoint, all
D x T with D >= 2 (a 1-D mesh of n ranks is n x 1), each stage's ranks listed in its mesh's
order (replica k of one stage talks to replica k of the next), no value moves between meshes in pieces,
every split along mesh axis 0 divides evenly, and ZeRO is off. Otherwise it returns the reason,
a string, and compile() lowers every rank.
Requires: find_meshes, split_stages (the programs' reshards), infer_sbp (every node's layout).
"""
from __future__ import annotations

from typing import List, Sequence, Union

import torch.fx as fx

from ..meta import META_SBP, META_TENSOR, TensorMeta
from ..placement import Split, flat, mesh_shape
from ..plan.plan import StageInfo
from ..plan.program import StageProgram
from ..plan.templates import RowSymmetry


def find_plan_symmetry(stages: Sequence[StageInfo], meshes: Sequence[tuple], gm: fx.GraphModule,
                       programs: Sequence[StageProgram], zero_stage: int) -> Union[RowSymmetry, str]:
    reordered = next((s.stage_id for s, mesh in zip(stages, meshes) if tuple(s.ranks) != flat(mesh)), None)
    if reordered is not None:
        return f"stage {reordered} lists its ranks in another order than its mesh"
    grids = _distinct_grids(meshes)
    if isinstance(grids, str):
        return grids
    rows = len(grids[0])
    if rows < 2:
        return "one replica per stage: nothing to share"
    if zero_stage:
        return f"ZeRO stage {zero_stage} shards parameters by data rank"
    if any(prog.reshard for prog in programs):
        return "values move between meshes of other shapes in pieces"
    uneven = _uneven_split(gm)
    if uneven:
        return uneven
    return RowSymmetry(tuple(grids))


def _distinct_grids(meshes: Sequence[tuple]) -> Union[List[tuple], str]:
    """Each distinct mesh once, as rows of ranks; or why they are not one shape, apart."""
    grids: List[tuple] = []
    for mesh in dict.fromkeys(meshes):
        grid = tuple(tuple(row) for row in mesh) if len(mesh_shape(mesh)) == 2 else tuple((r,) for r in mesh)
        if grids and mesh_shape(grid) != mesh_shape(grids[0]):
            return f"stage meshes of shapes {mesh_shape(grids[0])} and {mesh_shape(grid)}"
        grids.append(grid)
    seen = set()
    for grid in grids:
        ranks = {r for row in grid for r in row}
        if ranks & seen:
            return "two stage meshes share some ranks but not all"
        seen |= ranks
    return grids


def _uneven_split(gm: fx.GraphModule) -> str:
    """The first node split along mesh axis 0 into shards of other sizes, as a reason; ''."""
    for node in gm.graph.nodes:
        sig, meta = node.meta.get(META_SBP), node.meta.get(META_TENSOR)
        if sig is None or not sig.out or not isinstance(sig.out[0], Split):
            continue
        if not isinstance(meta, TensorMeta):
            return f"{node.name} is split along the replicas and its shape is not known"
        n = mesh_shape(sig.mesh)[0]
        if meta.shape[sig.out[0].dim] % n:
            return f"{node.name} ({list(meta.shape)}) splits unevenly over {n} replicas"
    return ""
