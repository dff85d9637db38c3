"""Settings read from environment variables (GRAPHC_DEBUG, GRAPHC_TIMEOUT, ...), checked for
the user. A value type below every layer: the compiler and the runtime both read them."""
from __future__ import annotations

import math
import os

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
