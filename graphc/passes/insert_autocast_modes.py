"""insert_autocast_modes: keeps build()'s torch.autocast regions in each stage program.

Invariant: in every stage program, each node runs in the autocast state build() traced it
in (META_AUTOCAST, NOTE: Autocast regions): a `set_autocast(state)` call sits wherever the
state changes, and the program leaves every region before its output, so the executor's
backward and the optimizer run outside autocast as in eager. Nodes graphc inserted
(boxing, sends) run in the state of the node before them.
Requires: split_stages (node metadata copied into the stage programs).
"""
from __future__ import annotations

from typing import List

import torch.fx as fx

from ..meta import META_AUTOCAST
from ..ops.autocast import set_autocast
from ..plan.program import StageProgram


def insert_autocast_modes(programs: List[StageProgram]) -> List[StageProgram]:
    for program in programs:
        if _insert(program.module.graph):
            program.module.recompile()
    return programs


def _insert(graph: fx.Graph) -> bool:
    state, changed = (), False
    for node in list(graph.nodes):
        if node.op in ("placeholder", "get_attr"):
            continue
        want = () if node.op == "output" else node.meta.get(META_AUTOCAST, state)
        if want != state:
            with graph.inserting_before(node):
                graph.call_function(set_autocast, (want,))
            state, changed = want, True
    return changed
