"""find_meshes: each stage's device mesh, from every placement the user declared.

Invariant: one mesh per stage (placement ranks; nested, 2-D, where a declared placement
names the stage's ranks as a 2-D mesh, sbp/layout.stage_meshes), read from set_stage,
to_global on parameters and buffers, GlobalTensor inputs and to_global inside build().
Recorded in the compile history as `declared_meshes`.
Requires: the final stages, and the traced graph (its to_global_op nodes).
"""
from __future__ import annotations

from typing import List

import torch.fx as fx

from ..plan.plan import StageInfo
from ..sbp.declared import DeclaredLayouts, conversion_target, to_global_op
from ..sbp.layout import stage_meshes


def find_meshes(stages: List[StageInfo], spec, gm: fx.GraphModule, input_layouts,
                declared: DeclaredLayouts) -> List[tuple]:
    """spec: the compiler.CompileSpec (its modules' set_stage placements); input_layouts: per
    input, None or the Layout of a GlobalTensor input."""
    return stage_meshes(stages, _declared_placements(spec, gm, input_layouts, declared))


def _declared_placements(spec, gm: fx.GraphModule, input_layouts, declared: DeclaredLayouts):
    """Every placement the user named: set_stage, to_global on parameters, inputs, build()."""
    found = [c.placement for c in spec.modules.values() if c.placement]
    found += declared.placements()
    found += [layout.placement for layout in input_layouts if layout]
    found += [conversion_target(n).placement for n in gm.graph.nodes if n.target is to_global_op]
    return found
