"""Aside: `graphc plan`'s charts drawn in a forked child while the command goes on.

NOTE: Charts drawn aside
Drawing a chart (matplotlib's layout, rasterising, PNG and SVG encoding) is a third of what
`graphc plan --simulate` does after compiling, and nothing else waits for it: the plans,
tables and traces are written from the same simulated timelines without it. So write_all
hands each chart to `Aside.run`, which forks (the child has the timeline already, no copy
is sent) and draws it there while this process simulates and writes the rest; `Aside.wait`
then waits for every child and raises a GraphcError naming the chart whose child failed
(its traceback is on stderr). The files, and every byte the command prints, are those of
drawing in this process: the children print nothing and their file names are known before.
It only saves wall time (the CPU time is the same, spent on another core); where fork does
not exist or this process runs other threads (a fork copies only the calling thread, and a
lock another thread holds would never be released in the child), it draws here.
"""
from __future__ import annotations

import gc
import os
import sys
import threading
import traceback
from typing import Callable, List, Tuple

from ..errors import GraphcError


class Aside:
    """Functions run in forked children (or here, see NOTE: Charts drawn aside)."""

    def __init__(self, forking: bool = True):
        self.forking = forking and hasattr(os, "fork")
        self.children: List[Tuple[int, str]] = []     # (pid, what it draws)

    def run(self, what: str, fn: Callable, *args) -> None:
        """Calls fn(*args), in a child where it can; `what` names it in an error."""
        if not self.forking or threading.active_count() > 1:
            fn(*args)
            return
        sys.stdout.flush()          # else the child would print this process's buffered text too
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(fn, args)
        self.children.append((pid, what))

    def wait(self) -> None:
        """Waits for every child; a GraphcError if one failed."""
        failed = []
        for pid, what in self.children:
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                failed.append(what)
        self.children = []
        if failed:
            raise GraphcError(f"graphc plan: drawing {', '.join(failed)} failed (the traceback is "
                              "above). Fix: report it, and pass --no-chart to write the plans "
                              "and tables without charts.")


def _child(fn: Callable, args) -> None:
    """The forked child: runs fn and leaves without the parent's exit handlers. Its collector
    is off: a full collection would walk (and, writing to them, copy) the parent's millions of
    objects, which the child shares until it writes them, and the child lives for one chart."""
    gc.disable()
    code = 0
    try:
        fn(*args)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
