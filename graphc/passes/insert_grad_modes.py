"""insert_grad_modes: keeps build()'s torch.no_grad() / enable_grad() regions in each stage program.

Invariant: in every stage program of a training graph, each node runs in the grad mode
build() traced it in (META_GRAD_ENABLED, recorded by trace_build): a
`torch._C._set_grad_enabled(mode)` call sits wherever the mode changes, and the program
ends in grad mode, as the executor (which runs it under torch.enable_grad()) expects.
fx itself drops context managers while tracing, so without this a no_grad region's
ops would be recorded by autograd and parameters eager leaves alone would be trained.
Nodes graphc inserted (boxing, local forms) run in the mode of the node before them.
Inference programs run wholly without grad and are left as they are.
Requires: split_stages (node metadata copied into the stage programs).
"""
from __future__ import annotations

from typing import List

import torch
import torch.fx as fx

from ..meta import META_GRAD_ENABLED
from ..plan.program import StageProgram


def insert_grad_modes(programs: List[StageProgram], training: bool) -> List[StageProgram]:
    if not training:
        return programs
    for program in programs:
        if _insert(program.module.graph):
            program.module.recompile()
    return programs


def _insert(graph: fx.Graph) -> bool:
    mode, changed = True, False
    for node in list(graph.nodes):
        if node.op in ("placeholder", "get_attr"):
            continue
        want = True if node.op == "output" else node.meta.get(META_GRAD_ENABLED, mode)
        if want != mode:
            with graph.inserting_before(node):
                graph.call_function(torch._C._set_grad_enabled, (want,))
            mode, changed = want, True
    return changed
