"""Plan-only mode: what `graphc plan` turns on while it runs a training script.

In plan mode `Graph._compile` compiles for a world of `nproc` ranks in this one process
(no torch.distributed, no accelerator: only shapes are propagated, on fake tensors),
writes every rank's plan and the charts, and leaves the graph without a runtime; the
graph's first training step then stops the script with PlanModeExit, which the CLI
catches. Graphs compiled with `graph.compile(...)` before that step are all written:
the first to DIR, the k-th (k >= 1, in compile order) to DIR/graph<k>_<ClassName>/.

The mode is set by `plan_mode(...)` (the CLI) or by the environment variables
GRAPHC_PLAN_NPROC and GRAPHC_PLAN_OUT (and GRAPHC_PLAN_SIMULATE=measure|h100|...,
GRAPHC_PLAN_RANKS=0,7,-1 for the ranks whose plan files are written), so
`GRAPHC_PLAN_NPROC=4 GRAPHC_PLAN_OUT=plans python train.py` works too.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from ..errors import GraphcError


class PlanModeExit(Exception):
    """Raised at a graph's first step in plan mode: the plans are written, stop the script."""


@dataclass
class PlanMode:
    nproc: int
    out: str
    simulate: Optional[str] = None      # None, "measure", or a device preset name
    chart: bool = True
    ranks: Optional[str] = None         # whose plan files: None (default), "all", "0,7,-1"
    written: List[str] = field(default_factory=list)   # one output folder per graph

    def folder_for(self, graph) -> str:
        k = len(self.written)
        return self.out if k == 0 else os.path.join(self.out, f"graph{k}_{type(graph).__name__}")


_ACTIVE: Optional[PlanMode] = None


def active() -> Optional[PlanMode]:
    """The plan mode in force, from plan_mode(...) or the GRAPHC_PLAN_* variables; else None."""
    global _ACTIVE
    if _ACTIVE is None and os.environ.get("GRAPHC_PLAN_NPROC"):
        _ACTIVE = PlanMode(_nproc(os.environ["GRAPHC_PLAN_NPROC"], "GRAPHC_PLAN_NPROC"),
                           os.environ.get("GRAPHC_PLAN_OUT", "graphc_plan"),
                           os.environ.get("GRAPHC_PLAN_SIMULATE") or None,
                           ranks=os.environ.get("GRAPHC_PLAN_RANKS") or None)
    return _ACTIVE


@contextmanager
def plan_mode(nproc: int, out: str, simulate: Optional[str] = None, chart: bool = True,
              ranks: Optional[str] = None):
    """Within the block, compiling a Graph writes its plans instead of preparing to train."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, PlanMode(_nproc(nproc), out, simulate, chart, ranks)
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = previous


def _nproc(value, source: str = "plan mode") -> int:
    try:
        n = int(value) if not isinstance(value, (bool, float)) else 0
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise GraphcError(f"{source} needs a number of ranks >= 1, found {value!r}; "
                          "e.g. graphc plan train.py --nproc 4 --out plans")
    return n


def compile_graph(graph, args):
    """Graph._compile in plan mode: compile for `nproc` ranks here, write the files.

    Returns the CompiledGraph; the graph is left without a runtime (see stop_before_step).
    """
    from .. import compiler
    from .dump import write_all
    mode = active()
    example = [torch.empty(g_shape, dtype=local.dtype) for local, (g_shape, _, _) in args]
    compiled = compiler.compile(graph, example, mode.nproc, **_layouts(args))
    folder = mode.folder_for(graph)
    write_all(graph, compiled, folder, mode)
    mode.written.append(folder)
    return compiled


def _layouts(args) -> dict:
    """GlobalTensor inputs' (placement, sbp), as Graph._compile passes them."""
    return {"input_layouts": [(where, sbp) if sbp is not None else None
                              for _, (_, sbp, where) in args]}


def stop_before_step(graph) -> None:
    """The graph's first step in plan mode: everything is written, so end the script here."""
    mode = active()
    raise PlanModeExit(f"graphc plan: stopped before {type(graph).__name__}'s first step; "
                       f"plans written to {', '.join(mode.written) if mode else '?'}")
