"""Settings read from environment variables (GRAPHC_DEBUG, GRAPHC_TIMEOUT, ...), checked for
the user. A value type below every layer: the compiler and the runtime both read them."""
from __future__ import annotations

import math
import os

from .errors import GraphcError


def seconds_from_env(name: str, default: float) -> float:
    """A duration in seconds from environment variable `name`, checked for the user."""
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
