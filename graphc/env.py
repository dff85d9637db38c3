"""Settings read from environment variables (GRAPHC_DEBUG, GRAPHC_TIMEOUT, ...), checked for
the user. A value type below every layer: the compiler and the runtime both read them."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Set

from .errors import GraphcError


# The sensible range of each duration setting, in seconds, and what it bounds. Below the
# minimum, ordinary work (a peer's compile before the first step, a step's transfer, a busy
# host answering keepalive probes) outlasts the wait, so every run would fail as a stall.
_SECONDS_RANGES = {
    "GRAPHC_TIMEOUT": (1.0, 7 * 86400.0, "the longest a rank waits for another (a transfer, "
                       "a collective, every rank's arrival at a graph's first call)"),
    "GRAPHC_HEARTBEAT_TIMEOUT": (1.0, 86400.0, "how long a rank's host may leave keepalive "
                                 "probes unanswered before the rank is declared dead"),
}


def seconds_from_env(name: str, default: float) -> float:
    """A duration in seconds from environment variable `name`, checked for the user (a number
    > 0, within _SECONDS_RANGES[name] where the setting has a range)."""
    raw = os.environ.get(name)
    if raw is None:
        return float(default)
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):  # timedelta would raise, 0 times out at once
        raise GraphcError(f"{name} must be a number of seconds, found {raw!r}; expected a finite "
                          f"number > 0. Fix: unset it (default {default:g}) or set e.g. "
                          f"{name}={default:g}.")
    low, high, what = _SECONDS_RANGES.get(name, (0.0, math.inf, ""))
    if not low <= value <= high:
        why = ("ordinary work outlasts so short a wait, and every run would fail as a stall"
               if value < low else "so long a wait makes a stalled rank look like a hang")
        raise GraphcError(
            f"{name}={raw} is out of range: it is {what}, in seconds; expected {low:g} to "
            f"{high:g} s, found {value:g} s: {why}. Fix: unset it (default {default:g} s) or "
            f"set e.g. {name}={default:g}.")
    return value


def int_from_env(name: str, default: int, minimum: int = 0, unit: str = "") -> int:
    """An integer setting from environment variable `name`, checked for the user."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        what = f"an int{' number of ' + unit if unit else ''} >= {minimum}"
        raise GraphcError(f"{name} must be {what}, found {raw!r}. Fix: unset it (default "
                          f"{default}) or set e.g. {name}={default}.")
    return value


# NOTE: Environment variables. Every GRAPHC_* variable is declared once, in VARIABLES below:
# its default, the values it accepts, what it means, and how its text is checked. Modules
# read one with `env.read(name)`, never from os.environ, so a bad value fails with the same
# message wherever it is read. docs/design.md's table of variables is generated from
# VARIABLES (`markdown_table()`); tests/test_env.py checks the table and that nothing else
# in graphc reads a GRAPHC_* variable from os.environ.
@dataclass(frozen=True)
class Variable:
    """One GRAPHC_* environment variable."""
    name: str
    default: str               # the text an unset variable stands for
    accepts: str               # the values a user may set, as the docs table shows them
    meaning: str
    check: Callable[[str], object]   # the text -> its value; raises GraphcError if bad


def _seconds(name: str, default: float) -> Variable:
    """A duration, checked by seconds_from_env (which reads the variable itself)."""
    low, high, what = _SECONDS_RANGES[name]
    return Variable(name, f"{default:g}", f"seconds, {low:g} to {high:g}", what,
                    lambda raw: seconds_from_env(name, default))


def _int(name: str, default: int, minimum: int, unit: str, meaning: str) -> Variable:
    """A count, checked by int_from_env (which reads the variable itself)."""
    return Variable(name, str(default), f"an int{' number of ' + unit if unit else ''} >= {minimum}",
                    meaning, lambda raw: int_from_env(name, default, minimum, unit))


def _choice(name: str, default: str, choices: Sequence[str], unset: str, meaning: str) -> Variable:
    def check(raw: str) -> str:
        if raw not in choices:
            raise GraphcError(f"{name} must be {', '.join(choices[:-1])} or {choices[-1]}, found "
                              f"{raw!r}. Fix: unset it ({unset}) or set one of those.")
        return raw
    return Variable(name, default, ", ".join(choices), meaning, check)


def _ranks(raw: str) -> Optional[Set[int]]:
    """GRAPHC_LOG_RANKS's text as a set of ranks; None means every rank."""
    raw = raw.strip()
    if raw.lower() == "all":
        return None
    try:
        ranks = {int(part) for part in raw.split(",") if part.strip()}
    except ValueError:
        ranks = set()
    if not ranks or min(ranks) < 0:
        raise GraphcError(f"GRAPHC_LOG_RANKS must be 'all' or a list of ranks such as '0,3', "
                          f"found {raw!r}. Fix: unset it (rank 0 prints) or set e.g. "
                          f"GRAPHC_LOG_RANKS=all.")
    return ranks


def _text(raw: str) -> str:
    return raw


VARIABLES: Dict[str, Variable] = {v.name: v for v in (
    _int("GRAPHC_DEBUG", 0, 0, "", "how much of the compilation to print: 1 a summary, 2 each "
         "pass's time, 3 plans, 4 the whole history, 5 also checks every pass's node annotations "
         "(graphc/compiler.py, graphc/passes/verify_meta.py)"),
    Variable("GRAPHC_LOG_RANKS", "0", "all, or ranks such as 0,3",
             "the ranks whose graphc records print (graphc/log.py)", _ranks),
    _seconds("GRAPHC_TIMEOUT", 300),
    _seconds("GRAPHC_HEARTBEAT_TIMEOUT", 10),
    _choice("GRAPHC_P2P", "auto", ("auto", "shm", "gloo"), "auto: shared memory where it can",
            "the transport of cpu channels (graphc/runtime/comm.py): auto is shared memory "
            "between ranks of one host, gloo elsewhere"),
    _choice("GRAPHC_RETRACE", "0", ("0", "1"), "0: off",
            "1 traces build() again on every call and compares it with the plan in use: a "
            "difference is a Python value the guards missed, a GraphcError naming it "
            "(graphc/executable.py, NOTE: Retrace check)"),
    _int("GRAPHC_SHM_MAX_MB", 1024, 1, "MiB", "the largest shared-memory ring of one channel"),
    Variable("GRAPHC_TRACE", "", "0, 1, or a file path", "1 records each step's events "
             "(graph.last_stats.events); a path also writes the merged Chrome trace "
             "(graphc/runtime/trace.py)", _text),
    Variable("GRAPHC_PLAN_NPROC", "", "a number of ranks >= 1", "plan mode: compile for this "
             "many ranks and write the plans instead of training (graphc/modes.py)", _text),
    Variable("GRAPHC_PLAN_OUT", "graphc_plan", "a folder", "plan mode: where the files go", _text),
    Variable("GRAPHC_PLAN_SIMULATE", "", "measure, or a device such as h100",
             "plan mode: also simulate the step with these costs", _text),
    Variable("GRAPHC_PLAN_RANKS", "", "ranks such as 0,7,-1", "plan mode: the ranks whose plan "
             "files are written (unset: all)", _text),
    _choice("GRAPHC_VERIFY_PLANS", "rank", ("rank", "world"), "rank: each rank its own plan",
            "which plans a running rank compiles and verifies: its own, its peers checked at "
            "startup by digests (NOTE: Plan digests), or every rank's, verified together as "
            "graphc plan does (slow at thousands of ranks)"),
    Variable("GRAPHC_PLAN_CACHE", "", "a folder", "keep each rank's compiled plans there, keyed "
             "by its inputs, so a restart does not lower them again; a stale or unreadable entry "
             "is ignored with a warning (graphc/plan_cache.py, NOTE: Plan cache)", _text),
    Variable("GRAPHC_AUTO_CACHE", "", "a folder", "where enable_auto_parallel keeps searched "
             "layouts, keyed by the model and the cluster (unset: ~/.cache/graphc/auto; "
             "graphc/auto/cache.py, NOTE: Search cache)", _text),
    Variable("GRAPHC_ROUTING_OUT", "", "a folder", "each rank writes its expert-parallel "
             "layers' tokens per expert of its first step there, for `graphc plan --simulate "
             "--routing` (graphc/ops/routing_log.py, NOTE: Routing log)", _text),
)}


def read(name: str):
    """The value of environment variable `name` (declared in VARIABLES), checked for the user;
    what its declared default stands for when unset."""
    var = VARIABLES[name]
    return var.check(os.environ.get(name, var.default))


def markdown_table() -> str:
    """VARIABLES as the table docs/design.md shows (tests/test_env.py keeps the two equal)."""
    rows = [f"| `{v.name}` | {f'`{v.default}`' if v.default else 'unset'} | {v.accepts} | {v.meaning} |"
            for v in VARIABLES.values()]
    return "\n".join(["| variable | default | accepts | meaning |", "|---|---|---|---|", *rows])
