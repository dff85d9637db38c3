"""ZeRO stage 3 unit boundaries in a stage program (insert_zero_units puts the calls).

`zero_unit_begin(k)` runs before unit k's first op in the stage's forward and
`zero_unit_end(k)` after its last; the runtime's UnitGatherer for the running compute
(`gathering_units`) does what the plan lists for them there: wait for the unit's gather and
launch the next one, or free the unit. Outside a compute that gathers per unit (a program
run another way) they do nothing. See NOTE: ZeRO units in graphc/runtime/zero_units.py.
"""
from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Optional

_UNITS: contextvars.ContextVar[Optional[object]] = contextvars.ContextVar("graphc_zero_units", default=None)


@contextmanager
def gathering_units(gatherer):
    """Within the block the unit boundaries of a stage program call `gatherer` (its begin(k)
    and end(k))."""
    token = _UNITS.set(gatherer)
    try:
        yield
    finally:
        _UNITS.reset(token)


def zero_unit_begin(unit: int) -> None:
    gatherer = _UNITS.get()
    if gatherer is not None:
        gatherer.begin(unit)


def zero_unit_end(unit: int) -> None:
    gatherer = _UNITS.get()
    if gatherer is not None:
        gatherer.end(unit)
