"""graph.config's options of numeric precision: autocast, the gradient reduce dtype, parameters
stored in a lower precision with float32 masters."""
from __future__ import annotations

import torch

from ..errors import GraphcError
from .options import Options


_REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class PrecisionOptions(Options):
    """`graph.config`'s precision options (a base of GraphConfig)."""

    def enable_amp(self, enabled: bool = True, dtype: torch.dtype = torch.bfloat16) -> None:
        """Automatic mixed precision (OneFlow's name): build() runs under torch.autocast.

        Every op of build() runs as it would inside `with torch.autocast(device, dtype):`
        (matmuls and convolutions in `dtype`, reductions, norms and losses in float32, by
        torch's autocast lists for the placements' device type), and `loss.backward()` runs
        outside it, as the eager recipe does. Parameters and optimizer state stay float32
        (the master weights), gradients are float32 and accumulate in float32 over the
        micro-batches, and gradient all-reduces run in float32. Values crossing stages
        travel in the dtype autocast gave them (half the bytes for bf16). On CPU the result
        equals eager autocast bit for bit (docs/design.md, NOTE: Autocast regions).

        Args:
            enabled: True to run build() under autocast.
            dtype: torch.bfloat16 or torch.float16.

        Example:
            self.config.enable_amp(True, dtype=torch.bfloat16)   # in the Graph's __init__
        """
        self._check_open("enable_amp")
        if not isinstance(enabled, bool):
            raise GraphcError(f"enable_amp expects True or False, found {enabled!r}")
        if dtype not in (torch.bfloat16, torch.float16):
            raise GraphcError(f"enable_amp: dtype must be torch.bfloat16 or torch.float16, found "
                              f"{dtype!r}. Fix: self.config.enable_amp(True, dtype=torch.bfloat16).")
        self.amp_dtype = dtype if enabled else None

    def set_grad_reduce_dtype(self, dtype: torch.dtype = torch.float32) -> None:
        """The dtype data-parallel gradients are all-reduced in. torch.float32 (the default)
        reduces each gradient in its own dtype: float32 for float32 parameters, amp included.

        torch.bfloat16 or torch.float16 halves the bytes of every gradient bucket: each rank
        casts its float32 gradient (its addend of the sum) down before the all-reduce and the
        sum back up to float32 after it, as torch DDP's bf16_compress_hook does. Gradients
        still accumulate in float32 over the micro-batches, and parameters and optimizer
        state stay float32; only the sum over ranks is rounded. The plan's ALL_REDUCE lists
        the gradients in this dtype and counts its bytes. Ties between stages and the
        gradient clipping norm are summed in float32 whatever this says.

        Args:
            dtype: torch.float32, torch.bfloat16 or torch.float16.

        Example:
            self.config.enable_amp(True, dtype=torch.bfloat16)
            self.config.set_grad_reduce_dtype(torch.bfloat16)   # half the bytes per bucket
        """
        self._check_open("set_grad_reduce_dtype")
        if dtype not in _REDUCE_DTYPES:
            raise GraphcError(f"set_grad_reduce_dtype: dtype must be one of "
                              f"{', '.join(map(str, _REDUCE_DTYPES))}, found {dtype!r}. Fix: "
                              "self.config.set_grad_reduce_dtype(torch.bfloat16).")
        self.grad_reduce_dtype = None if dtype == torch.float32 else dtype

    def set_param_dtype(self, dtype: torch.dtype) -> None:
        """Stores the model's parameters in `dtype` with a float32 master copy of each, held
        by the optimizer (Megatron's layout; See NOTE: Master parameters in
        graphc/runtime/master_params.py).

        The stage programs read bfloat16 (or float16) parameters: with enable_amp autocast's
        lists decide each op's dtype, without it every op computes in `dtype`, as eager on
        `model.to(dtype)`. Each micro-batch's gradient is added into its master's float32
        .grad, so gradients accumulate, are all-reduced (unless set_grad_reduce_dtype says
        otherwise), unscaled and clipped in float32; the optimizer steps on the masters and
        each parameter becomes its master rounded to `dtype`. state_dict() and
        full_state_dict() hold the float32 masters. Needs float32 parameters and an optimizer.
        With enable_zero stages 1 and 2 each rank holds only its rows of the masters and of
        the optimizer's state, and the parameters are all-gathered in `dtype` after the step
        (See NOTE: ZeRO with master parameters in graphc/runtime/zero.py); stage 3 is not
        available with it yet. torch.float32 turns it off.

        Args:
            dtype: torch.bfloat16, torch.float16, or torch.float32 (off).

        Example:
            self.config.enable_amp(True, dtype=torch.bfloat16)
            self.config.set_param_dtype(torch.bfloat16)   # 18 bytes per parameter with Adam
        """
        self._check_open("set_param_dtype")
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise GraphcError(f"set_param_dtype: dtype must be torch.bfloat16, torch.float16 or "
                              f"torch.float32 (off), found {dtype!r}. Fix: "
                              "self.config.set_param_dtype(torch.bfloat16).")
        self.param_dtype = None if dtype == torch.float32 else dtype
