"""config.set_param_dtype: parameters stored in a low dtype, float32 masters in the optimizer.

NOTE: Master parameters
`self.config.set_param_dtype(torch.bfloat16)` stores every floating parameter of the model
in bfloat16 (or float16) and keeps a float32 master copy of each, which the optimizer holds
(Megatron's layout; what eager does with `model.to(torch.bfloat16)` and a float32 copy per
parameter):
- build() is traced with the parameters in the low dtype (stored_in), so the plan's dtypes
  are those the stage programs run with: without enable_amp every op computes in the low
  dtype, with it autocast's lists decide, as in eager;
- when the graph takes its parameters (GraphState.take_ownership, after tensor-parallel
  sharding and the device move) each one this rank holds gets its master: a float32
  Parameter holding its value, which replaces it in the optimizer's param groups (and takes
  its optimizer state); then the parameter's storage becomes the low dtype;
- autograd produces each micro-batch's gradient in the low dtype on the parameter; a
  post-accumulate-grad hook (registered before GradSync's) adds it into the master's .grad
  in float32 and drops it, so gradients accumulate over micro-batches in float32;
- everything downstream reads the masters' gradients: data-parallel and tied all-reduces
  (in float32 unless config.set_grad_reduce_dtype), loss-scale unscaling, clipping, the
  optimizer step; after a step the masters are rounded into the parameters (copy_back);
- checkpoints (state_dict, full_state_dict) save and load the masters: the user's model in
  its own dtype; a load rounds them into the parameters again.
Bytes per parameter with Adam: 2 (parameter) + 4 (master) + 4 (gradient) + 8 (state) = 18.
With enable_zero (stages 1 and 2) the masters are sharded: See NOTE: ZeRO with master
parameters in zero.py.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterable, List, Optional, Set

import torch

from .grad_hooks import internal

PARAM_DTYPES = (torch.bfloat16, torch.float16)


@contextmanager
def stored_in(root: torch.nn.Module, dtype: Optional[torch.dtype]):
    """Within the block, every float32 parameter of `root` holds its value in `dtype` (tracing
    sees the dtypes the stage programs will run with); restored after. A no-op for None and
    for parameters already in `dtype` (a later compile)."""
    held = []
    if dtype is not None:
        for p in root.parameters():
            if p.dtype == torch.float32:
                held.append((p, p.data))
                p.data = p.data.to(dtype)
    try:
        yield
    finally:
        for p, data in held:
            p.data = data


class MasterParams:
    """This rank's parameters (low dtype) and their float32 masters (NOTE: Master parameters)."""

    def __init__(self, pairs: List[tuple]):
        self.pairs = pairs                                   # (parameter, master)
        self.by_param: Dict[int, torch.nn.Parameter] = {id(p): m for p, m in pairs}
        # masters ZeRO holds as this rank's rows (their whole storage freed): a gather, not
        # copy_back, fills their parameters (See NOTE: ZeRO with master parameters, zero.py)
        self.rows_only: Set[int] = set()
        self.hooks = [p.register_post_accumulate_grad_hook(_into_master(m)) for p, m in pairs
                      if p.requires_grad]

    @classmethod
    def take(cls, params: Iterable[torch.nn.Parameter], optimizer, dtype: torch.dtype) -> "MasterParams":
        """Masters for `params` (float32 ones, each once), held by `optimizer` in their place;
        the parameters' storage becomes `dtype`."""
        pairs, seen = [], set()
        for p in params:
            if id(p) in seen or p.dtype != torch.float32:
                continue
            seen.add(id(p))
            pairs.append((p, torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)))
        masters = {id(p): m for p, m in pairs}
        if optimizer is not None:
            for group in optimizer.param_groups:
                group["params"] = [masters.get(id(p), p) for p in group["params"]]
            for p, m in pairs:   # state loaded before the first call follows its parameter
                if p in optimizer.state:
                    optimizer.state[m] = optimizer.state.pop(p)
        for p, _ in pairs:
            p.data = p.data.to(dtype)
        return cls(pairs)

    def master_of(self, p: torch.Tensor) -> torch.Tensor:
        """The tensor whose .grad holds `p`'s gradient: its master, or itself."""
        return self.by_param.get(id(p), p)

    def masters(self) -> List[torch.nn.Parameter]:
        return [m for _, m in self.pairs]

    def hold_rows(self, master: torch.nn.Parameter) -> None:
        """ZeRO holds `master` as rows from now on: copy_back leaves its parameter alone."""
        self.rows_only.add(id(master))

    @torch.no_grad()
    def copy_back(self) -> None:
        """Each parameter becomes its master rounded to its dtype (after a step, or a load);
        one whose master ZeRO holds as rows is gathered instead."""
        for p, m in self.pairs:
            if id(m) not in self.rows_only:
                p.copy_(m)


def _into_master(master: torch.nn.Parameter):
    """The hook moving a micro-batch's gradient (low dtype) into master.grad (float32)."""
    @internal  # NOTE: Post-accumulate-grad hooks (grad_hooks.py)
    def accumulate(p: torch.Tensor) -> None:
        g, p.grad = p.grad, None
        if master.grad is None:
            master.grad = g.to(master.dtype)
        else:
            master.grad.add_(g)   # computed in float32: float(a) + float(g)
    return accumulate
