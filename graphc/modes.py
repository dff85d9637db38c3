"""The two modes a script runs in under graphc's command line, as settings the Graph reads:
plan mode (`graphc plan`) and check mode (`graphc check`, below).

Plan-only mode: `graphc plan` (or GRAPHC_PLAN_*) turns it on, Graph reads it.

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

This module is the setting only, a value below the API; the files are written by the
tools (See NOTE: Plan-mode writer).

Check mode: `graphc check` (and graphc.testing.check) turn it on. Every graph call is also
run eagerly (NOTE: Checked steps, graphc/checking/every_step.py): rank 0 keeps an eager copy
of the graph's model, optimizer and LR scheduler, steps it on the whole batch, and compares
the loss and every parameter with graphc's step. Each graph's comparisons are collected in
its report (`CheckMode.reports`), and after `steps` calls of any graph the run stops with
CheckDone, which the caller catches.
"""
from __future__ import annotations

import importlib
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional

import torch

from .errors import GraphcError

# NOTE: Plan-mode writer
# Writing a compiled graph's files (plans, stage programs, charts, simulation) is the tools'
# work, graphc/tools/dump.write_all, and the API never imports the tools (docs/design.md:
# Layers). So the writer travels with the mode: whoever turns plan mode on may install it
# (`graphc plan` passes write_all). A mode turned on by GRAPHC_PLAN_NPROC in a plain
# `python train.py` has nobody to install it, so it finds the writer by the name WRITER,
# imported when the first graph is written, as breakpoint() imports PYTHONBREAKPOINT's
# default pdb.set_trace. tests/test_layers.py checks that the name resolves to write_all.
WRITER = "graphc.tools.dump:write_all"


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
    # (graph, compiled, folder, mode) -> files written; None: the one named WRITER
    write: Optional[Callable] = None
    # graphc plan --auto: (graph, spec, specs, tree, mode) -> (Layout, CompiledGraph), the
    # tools' search (NOTE: Layout search), installed by the CLI as the writer is; None: off
    auto: Optional[Callable] = None

    def folder_for(self, graph) -> str:
        k = len(self.written)
        return self.out if k == 0 else os.path.join(self.out, f"graph{k}_{type(graph).__name__}")

    def write_graph(self, graph, compiled) -> None:
        """Writes a compiled graph's files to its folder, the next in compile order."""
        folder = self.folder_for(graph)
        (self.write or named_writer())(graph, compiled, folder, self)
        self.written.append(folder)


def named_writer() -> Callable:
    """The writer WRITER names (See NOTE: Plan-mode writer)."""
    module, name = WRITER.split(":")
    return getattr(importlib.import_module(module), name)


_PLAN: Optional[PlanMode] = None


def active_plan() -> Optional[PlanMode]:
    """The plan mode in force, from plan_mode(...) or the GRAPHC_PLAN_* variables; else None."""
    global _PLAN
    if _PLAN is None and os.environ.get("GRAPHC_PLAN_NPROC"):
        _PLAN = PlanMode(_nproc(os.environ["GRAPHC_PLAN_NPROC"], "GRAPHC_PLAN_NPROC"),
                           os.environ.get("GRAPHC_PLAN_OUT", "graphc_plan"),
                           os.environ.get("GRAPHC_PLAN_SIMULATE") or None,
                           ranks=os.environ.get("GRAPHC_PLAN_RANKS") or None)
    return _PLAN


@contextmanager
def plan_mode(nproc: int, out: str, simulate: Optional[str] = None, chart: bool = True,
              ranks: Optional[str] = None, write: Optional[Callable] = None,
              auto: Optional[Callable] = None):
    """Within the block, compiling a Graph writes its plans instead of preparing to train.

    write: what writes a compiled graph's files, called as write(graph, compiled, folder,
    mode); by default graphc/tools/dump.write_all (See NOTE: Plan-mode writer).
    """
    global _PLAN
    previous, _PLAN = _PLAN, PlanMode(_nproc(nproc), out, simulate, chart, ranks, write=write,
                                      auto=auto)
    try:
        yield _PLAN
    finally:
        _PLAN = previous


def _nproc(value, source: str = "plan mode") -> int:
    try:
        n = int(value) if not isinstance(value, (bool, float)) else 0
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise GraphcError(f"{source} needs a number of ranks >= 1, found {value!r}; "
                          "e.g. graphc plan train.py --nproc 4 --out plans")
    return n


def stop_before_step(graph) -> None:
    """The graph's first step in plan mode: everything is written, so end the script here."""
    mode = active_plan()
    raise PlanModeExit(f"graphc plan: stopped before {type(graph).__name__}'s first step; "
                       f"plans written to {', '.join(mode.written) if mode else '?'}")


# -- graphc's bounds against eager: one table --------------------------------------------
# By the compared values' dtype. Check mode (`graphc check`, graphc.testing) bounds each value:
# |graphc - eager| <= t * (1 + |eager|) — the tests' oracle in float64 (tests/helpers.py); in
# float32 graphc's reordered sums differ by rounding. The first-step check of a training job
# (config.set_check_microbatching, checking/first_step.py) bounds a whole tensor by its largest
# value: max |graphc - eager| <= t * max(max |eager|, 1) — a safety net that stops a user's
# job with a GraphcError, so ten times looser in float64 than the tests' oracle.
class Bounds(NamedTuple):
    check: float         # check mode: per value, the tests' oracle
    first_step: float    # the first-step check of a training job: per tensor, by its largest value


TOLERANCES: Dict[torch.dtype, Bounds] = {
    torch.float64: Bounds(check=1e-10, first_step=1e-9),
    torch.float32: Bounds(check=1e-4, first_step=1e-4),
    torch.bfloat16: Bounds(check=1e-2, first_step=1e-2),
    torch.float16: Bounds(check=1e-2, first_step=1e-2),
}
OTHER_DTYPES = Bounds(check=1e-2, first_step=1e-2)


def tolerance(dtype: torch.dtype) -> Bounds:
    """graphc's bounds against eager for values of `dtype` (the table above)."""
    return TOLERANCES.get(dtype, OTHER_DTYPES)


# -- check mode ----------------------------------------------------------------------


class CheckDone(Exception):
    """Raised at a graph call after the checked steps: the comparison is complete."""


@dataclass
class CheckMode:
    steps: Optional[int] = 3                    # calls compared per graph; None: all
    reports: List[object] = field(default_factory=list)   # one StepReport per graph (rank 0)
    tolerance: Optional[float] = None           # None: tolerance(dtype).check

    def bound(self, dtype: torch.dtype) -> float:
        return self.tolerance if self.tolerance is not None else tolerance(dtype).check


_CHECKS: List[CheckMode] = []


def active_check() -> Optional[CheckMode]:
    return _CHECKS[-1] if _CHECKS else None


@contextmanager
def check_mode(mode: CheckMode):
    """Within the block, every graph call is compared with eager (See the module's doc)."""
    _CHECKS.append(mode)
    try:
        yield mode
    finally:
        _CHECKS.remove(mode)
