"""The mesh of each pipeline stage: its placement's ranks, 2-D when a 2-D placement covers them."""
from __future__ import annotations

from typing import Iterable, List

from ..errors import GraphcError


def stage_meshes(stages, placements: Iterable) -> List[tuple]:
    """One mesh per stage: the ranks of the first 2-D placement naming exactly the stage's
    ranks (set_stage, to_global on parameters or inputs), else the stage's flat ranks."""
    placements = [p for p in placements if p is not None]
    meshes = []
    for st in stages:
        mesh = tuple(st.ranks)
        for p in placements:
            if p.ndim == 2 and sorted(p.flat_ranks) == sorted(st.ranks):
                if isinstance(mesh[0], tuple) and mesh != p.ranks:
                    raise GraphcError(
                        f"stage {st.stage_id} is given two 2-D meshes, {mesh} and {p.ranks}; "
                        "use one 2-D placement for all tensors of a stage")
                mesh = p.ranks
        meshes.append(mesh)
    return meshes
