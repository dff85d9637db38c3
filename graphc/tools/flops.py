"""FLOPs of a stage's forward, split by the rate they run at: low precision or full.

An accelerator runs bf16/fp16 matmuls and convolutions at its tensor-core rate and float32
ones at its (much lower) float32 rate (graphc/tools/network.py's presets have both), so a
program under autocast (enable_amp, or torch.autocast regions in build()) costs its FLOPs
at the low-precision rate only where autocast actually cast them. Each op's FLOPs come
from torch's own formulas (torch.utils.flop_counter.flop_registry, FlopCounterMode's).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass
class Flops:
    low: int = 0        # of ops whose operands are bf16/fp16
    full: int = 0       # of every other op (float32, float64)
    ops: int = 0        # ops dispatched, with or without FLOPs: what a CPU rank's host time counts

    @property
    def total(self) -> int:
        return self.low + self.full

    def seconds(self, low_flops_per_s: float, full_flops_per_s: float) -> float:
        return self.low / low_flops_per_s + self.full / full_flops_per_s


class CountFlops(TorchDispatchMode):
    """Within the block, counts the FLOPs of every op torch has a formula for, and every op
    dispatched, in `.flops`.

    A cuda program counted on CPU fake tensors (graphc plan --device cuda on a machine
    without one) is not cast by its cuda autocast region; an op dispatched inside such a
    region counts at the low-precision rate, as it would run on the device.
    """

    def __init__(self):
        super().__init__()
        self.flops = Flops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.flops.ops += 1
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            n = formula(*args, **kwargs, out_val=out)
            if _low_precision(args):
                self.flops.low += n
            else:
                self.flops.full += n
        return out


def _low_precision(args) -> bool:
    t = next((a for a in tree_leaves(args) if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    if t is None:
        return False
    if t.dtype in LOW_PRECISION:
        return True
    return (t.device.type != "cuda" and torch.is_autocast_enabled("cuda")
            and torch.get_autocast_dtype("cuda") in LOW_PRECISION)
