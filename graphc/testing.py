"""graphc.testing: a job's N ranks run in this one process, and checked against eager.

    run = graphc.testing.local_world(make_graph, [(x, y)] * 3, nproc=8)
    run.losses, run.state                      # per step; full_state_dict after the last
    run = graphc.testing.local_world(make_graph, batches, nproc=64, check=True)
    assert run.ok, run.text()                   # every step equal to eager on the whole batch

Every rank is a thread standing for a process (NOTE: Local world,
graphc/runtime/local_world.py): it builds its own graph with `graph_factory()` (torch's
random state at the call is every rank's, as in N processes launched alike) and calls it;
compile, plans, stage programs and the instruction loop are the ones torchrun runs, only
transfers and collectives are in memory. `check_script` is `graphc check`.
"""
from __future__ import annotations

import inspect
import os
import runpy
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

from .modes import CheckDone, CheckMode, check_mode
from .checking.first_step import _first_scalar
from .errors import GraphcError
from .runtime.local_world import LocalWorld

Inputs = Union[Sequence[Sequence[Any]], Callable[[int, int], Sequence[Any]]]


@dataclass
class LocalRun:
    """What a local world's ranks computed."""

    outputs: List[List[Any]]                 # [rank][step]: build()'s outputs on that rank
    losses: List[Optional[float]]            # per step: the first scalar output, where computed
    state: Dict[str, torch.Tensor]           # full_state_dict() after the last step
    graphs: List[Any]                        # each rank's Graph
    reports: List[Any] = field(default_factory=list)   # check=True: rank 0's StepReports

    @property
    def ok(self) -> bool:
        """Every checked graph agreed with eager at every step (check=True)."""
        return bool(self.reports) and all(r.ok for r in self.reports)

    def text(self) -> str:
        return "\n\n".join(r.text() for r in self.reports)


def local_world(graph_factory: Callable[..., Any], inputs: Inputs, nproc: int,
                steps: Optional[int] = None, check: bool = False,
                tolerance: Optional[float] = None) -> LocalRun:
    """Runs a graph's `nproc` ranks in this process.

    Args:
        graph_factory: builds the Graph (model, optimizer and all) on a rank; called on every
            rank, with the rank as argument if it takes one.
        inputs: the graph call's arguments per step, the same on every rank (a list of
            tuples), or a function (rank, step) -> arguments (a rank's own GlobalTensor parts).
        steps: how many calls (default: len(inputs)).
        check: also run every step eagerly on the whole batch and compare (NOTE: Checked
            steps): the result's `reports`, `ok` and `text()`.
        tolerance: the check's bound (default by dtype: 1e-10 in float64).
    """
    if callable(inputs):
        if steps is None:
            raise GraphcError("local_world: with inputs given as a function, pass steps=")
        args_of = inputs
    else:
        batches = list(inputs)
        steps = len(batches) if steps is None else steps
        args_of = lambda rank, step: batches[step]  # noqa: E731 - every rank alike
    takes_rank = _takes_rank(graph_factory)

    def rank_main(rank: int):
        graph = graph_factory(rank) if takes_rank else graph_factory()
        outs = [graph(*args_of(rank, step)) for step in range(steps)]
        state = graph.full_state_dict(rank0_only=True)
        return graph, outs, state

    mode = CheckMode(steps=None, tolerance=tolerance)
    world = LocalWorld(nproc)
    if check:
        with check_mode(mode):
            results = world.run(rank_main)
    else:
        results = world.run(rank_main)
    outputs = [outs for _, outs, _ in results]
    losses = [next((v for v in (_loss(outputs[r][s]) for r in range(nproc)) if v is not None), None)
              for s in range(steps)]
    return LocalRun(outputs, losses, results[0][2], [g for g, _, _ in results], mode.reports)


def _takes_rank(fn: Callable) -> bool:
    try:
        return len(inspect.signature(fn).parameters) >= 1
    except (TypeError, ValueError):
        return False


def _loss(out) -> Optional[float]:
    loss = _first_scalar(out)
    return None if loss is None else float(loss)


def check_script(script: str, script_args: Sequence[str], nproc: int, steps: int = 3,
                 dtype: Optional[torch.dtype] = torch.float64, tolerance: Optional[float] = None,
                 out=None) -> List[Any]:
    """`graphc check`: runs SCRIPT on `nproc` local ranks (each rank runs the whole script, as
    under torchrun, with RANK and WORLD_SIZE set), every graph call compared with eager for
    `steps` calls; prints each graph's report. Returns the reports (rank 0's)."""
    out = out or sys.stdout
    if not os.path.isfile(script):
        raise GraphcError(f"graphc check: script {script!r} not found")
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    saved_dtype = torch.get_default_dtype()
    sys.argv = [script] + list(script_args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    mode = CheckMode(steps=steps, tolerance=tolerance)

    def rank_main(rank: int) -> None:
        try:
            runpy.run_path(script, run_name="__main__")
        except CheckDone:
            pass
        except SystemExit as e:
            if e.code not in (None, 0):
                raise GraphcError(f"graphc check: rank {rank}: {script} exited with {e.code!r}") from e

    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)   # every rank starts from this thread's state
        with check_mode(mode):
            LocalWorld(nproc).run(rank_main)
    finally:
        sys.argv, sys.path = saved_argv, saved_path
        torch.set_default_dtype(saved_dtype)
    if not mode.reports:
        raise GraphcError(f"graphc check: {script} finished without calling a graphc.Graph. "
                          "Fix: make sure the script calls graph(...) (and that its arguments "
                          "reach that point).")
    for report in mode.reports:
        print(report.text(), file=out, flush=True)
    return mode.reports
