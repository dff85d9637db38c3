"""Check mode, the setting: `graphc check` (and graphc.testing.check) turn it on, Graph reads it.

In check mode every graph call is also run eagerly (NOTE: Checked steps, graphc/checking/every_step.py):
rank 0 keeps an eager copy of the graph's model, optimizer and LR scheduler, steps it on
the whole batch, and compares the loss and every parameter with graphc's step. Each graph's
comparisons are collected in its report (`CheckMode.reports`), and after `steps` calls of
any graph the run stops with CheckDone, which the caller catches.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

# per dtype of the compared values: |graphc - eager| <= ATOL + RTOL * |eager| (the tests'
# oracle in float64, tests/helpers.py; in float32 graphc's reordered sums differ by rounding)
TOLERANCE: Dict[torch.dtype, float] = {torch.float64: 1e-10, torch.float32: 1e-4,
                                       torch.bfloat16: 1e-2, torch.float16: 1e-2}


class CheckDone(Exception):
    """Raised at a graph call after the checked steps: the comparison is complete."""


@dataclass
class CheckMode:
    steps: Optional[int] = 3                    # calls compared per graph; None: all
    reports: List[object] = field(default_factory=list)   # one StepReport per graph (rank 0)
    tolerance: Optional[float] = None           # None: TOLERANCE by the values' dtype

    def bound(self, dtype: torch.dtype) -> float:
        return self.tolerance if self.tolerance is not None else TOLERANCE.get(dtype, 1e-2)


_ACTIVE: List[CheckMode] = []


def active() -> Optional[CheckMode]:
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def check_mode(mode: CheckMode):
    """Within the block, every graph call is compared with eager (See the module's doc)."""
    _ACTIVE.append(mode)
    try:
        yield mode
    finally:
        _ACTIVE.remove(mode)
