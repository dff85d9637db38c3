"""graphc.amp.GradScaler: loss scaling for float16 training (OneFlow's set_grad_scaler, torch's
scaler semantics), driven by the runtime once per step.

NOTE: Loss scaling
`self.set_grad_scaler(graphc.amp.GradScaler(...))` in the Graph's __init__. Every
micro-batch's loss is multiplied by the scale before its backward (the backward's seed is
scale / m instead of 1 / m; scale instead of 1 for a batch-sum loss, NOTE: Batch sums);
before the optimizer step (or the gradient clipping, which needs true gradients) each rank
multiplies its gradients by 1 / scale and looks for inf/NaN; one all-reduce (MAX) over
every rank makes an overflow found on any rank or stage everyone's, and then every rank
skips the step, drops the gradients and multiplies the scale by backoff_factor. After
growth_interval steps without an overflow the scale is multiplied by growth_factor. The
numbers are torch.amp.GradScaler's: a float32 scale, its reciprocal in float32, the same
update rule; eager's scaler loop gives the same steps.
"""
from __future__ import annotations

import math
from typing import Any, Dict

import torch

from .errors import GraphcError


class GradScaler:
    """Dynamic loss scaling, as torch.amp.GradScaler.

    Args:
        init_scale: the first scale (a power of two keeps scaling exact).
        growth_factor: the scale's factor after growth_interval steps without inf/NaN (> 1).
        backoff_factor: its factor after a step with inf/NaN (in (0, 1)).
        growth_interval: steps without inf/NaN before the scale grows.
        enabled: False makes the scaler a no-op (scale 1, never skips).

    Example:
        self.config.enable_amp(True, dtype=torch.float16)
        self.set_grad_scaler(graphc.amp.GradScaler(init_scale=2.0**16))
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True):
        if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
            raise GraphcError(f"GradScaler: init_scale must be a finite number > 0, found {init_scale!r}")
        if not (isinstance(growth_factor, (int, float)) and growth_factor > 1):
            raise GraphcError(f"GradScaler: growth_factor must be > 1, found {growth_factor!r}")
        if not (isinstance(backoff_factor, (int, float)) and 0 < backoff_factor < 1):
            raise GraphcError(f"GradScaler: backoff_factor must be in (0, 1), found {backoff_factor!r}")
        if not (isinstance(growth_interval, int) and not isinstance(growth_interval, bool) and growth_interval >= 1):
            raise GraphcError(f"GradScaler: growth_interval must be an int >= 1, found {growth_interval!r}")
        self.enabled = bool(enabled)
        self._scale = torch.tensor(float(init_scale) if enabled else 1.0, dtype=torch.float32)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = growth_interval
        self.growth_tracker = 0
        self.skipped_steps = 0

    def get_scale(self) -> float:
        return float(self._scale)

    def inverse(self) -> torch.Tensor:
        """1 / scale in float32, computed as torch's scaler computes it."""
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        """After a step: back off on inf/NaN, grow after growth_interval clean steps."""
        if not self.enabled:
            return
        if found_inf:
            self._scale = self._scale * self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self._scale = self._scale * self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": self.get_scale(), "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._scale = torch.tensor(float(state["scale"]), dtype=torch.float32)
        self.growth_tracker = int(state["growth_tracker"])


def checked_scaler(scaler, compiled: bool) -> GradScaler:
    """What Graph.set_grad_scaler accepts: a graphc.amp.GradScaler, before compiling."""
    if not isinstance(scaler, GradScaler):
        raise GraphcError(f"set_grad_scaler expects a graphc.amp.GradScaler, found {type(scaler).__name__}. "
                          "Fix: self.set_grad_scaler(graphc.amp.GradScaler(init_scale=2.0**16)).")
    if compiled:
        raise GraphcError("set_grad_scaler was called after the graph was compiled; call it in __init__")
    return scaler
