"""graphc's output: `logging.getLogger("graphc")`, one child logger per area.

  graphc.compile   compile summaries, pass timings, plans, fx graphs (GRAPHC_DEBUG=1..4)
  graphc.runtime   the actor runtime and its transports
  graphc.plan      `graphc plan` and the tools that read plans

Every record carries the rank it came from (`record.rank`) and prints as
`[rank N] graphc.<area>: message`. GRAPHC_LOG_RANKS chooses the ranks that print: `0`
(the default), `all`, or a list such as `0,3`; errors (ERROR and above) print on every
rank. graphc's warnings (warn_user) follow the same choice, so a warning that every rank
hits appears once per job, and they point at the user's file and line, not graphc's.

graphc's logger has its own stderr handler and does not propagate to the root logger
(no doubled lines under `logging.basicConfig`); add handlers to
`logging.getLogger("graphc")` to route its records elsewhere, or set its level to
WARNING to silence GRAPHC_DEBUG output.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Optional, Set

from . import env, world

ROOT = "graphc"
FORMAT = "[rank %(rank)s] %(name)s: %(message)s"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def get_logger(area: str) -> logging.Logger:
    """The logger of one area of graphc (`graphc.<area>`), rank-labelled and rank-filtered.

    Example:
        get_logger("compile").info("compiled %s", name)   # printed by rank 0 by default
    """
    _install_handler()
    logger = logging.getLogger(f"{ROOT}.{area}")
    if not any(isinstance(f, RankFilter) for f in logger.filters):
        logger.addFilter(RankFilter())
    return logger


def this_rank() -> int:
    """The global rank of this process: the process group's, else torchrun's RANK, else 0."""
    if world.current() is not None:
        return world.rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def log_ranks() -> Optional[Set[int]]:
    """GRAPHC_LOG_RANKS as a set of ranks; None means every rank."""
    return env.read("GRAPHC_LOG_RANKS")


def prints_here(rank: Optional[int] = None) -> bool:
    """Whether this rank (or `rank`) is one GRAPHC_LOG_RANKS lets print."""
    ranks = log_ranks()
    return ranks is None or (this_rank() if rank is None else rank) in ranks


def warn_user(message: str, category=UserWarning) -> None:
    """warnings.warn, attributed to the user's line that called into graphc, on the
    ranks GRAPHC_LOG_RANKS chooses (rank 0 by default: once per job, not once per rank)."""
    if prints_here():
        warnings.warn(message, category, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The stacklevel of the innermost frame outside the graphc package (warn_user's
    caller counts 1), so the warning names the user's file and line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


class RankFilter(logging.Filter):
    """Stamps `record.rank`; lets through errors anywhere, other records on chosen ranks."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "rank"):
            record.rank = this_rank()
        return record.levelno >= logging.ERROR or prints_here(record.rank)


class _StderrHandler(logging.StreamHandler):
    """Writes to the current sys.stderr (not the one at import), as logging.lastResort
    does, so redirected or captured stderr still gets graphc's lines."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def _install_handler() -> None:
    root = logging.getLogger(ROOT)
    if any(isinstance(h, _StderrHandler) for h in root.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(RankFilter())
    root.addHandler(handler)
    root.propagate = False
    if root.level == logging.NOTSET:
        root.setLevel(logging.DEBUG)   # GRAPHC_DEBUG decides what is logged at all
