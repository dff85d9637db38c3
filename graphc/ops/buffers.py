"""`module.buf = value` in a forward, as a stage program runs it (trace_build records the
assignment as a call of assign_buffer; See NOTE: Stage-program names in ops/__init__.py)."""
from __future__ import annotations

import torch


def assign_buffer(buffer: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`module.buf = value` in forward, as a stage program runs it: the buffer takes the value."""
    with torch.no_grad():
        return buffer.copy_(value)
