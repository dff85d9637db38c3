"""The user's post-accumulate-grad hooks, called once per step on the whole gradient.

NOTE: Post-accumulate-grad hooks
`param.register_post_accumulate_grad_hook(fn)` runs fn(param) in eager each time a backward
has added into param.grad: with the whole batch in one backward, once per step, on the
whole gradient. graphc's backward runs once per micro-batch, and on a data-parallel stage a
gradient is whole only after its all-reduce (GradSync) and a tied one after its tie sum. So
while a step's plan computes, the user's hooks are set aside (`UserGradHooks.set_aside`),
and they are called once, in the order they were registered, where gradients are final:
just before the step's ClipGradNorm or OptimizerStep (where an eager loop clips and steps
after backward), else at the step's end. graphc's own hooks on the same parameters
(GradSync, MasterParams) are marked with `internal` and stay. A parameter whose .grad is not
its whole gradient on this rank (a tensor-parallel or ZeRO shard; a set_param_dtype
parameter, whose gradient its float32 master holds) cannot be given eager's call: a hook on
it is refused.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.utils.hooks import RemovableHandle

from ..errors import GraphcError, defined_at

_INTERNAL = "graphc_internal_hook"


def internal(fn: Callable) -> Callable:
    """Marks one of graphc's own post-accumulate-grad hooks, which runs per micro-batch."""
    setattr(fn, _INTERNAL, True)
    return fn


class UserGradHooks:
    """This rank's parameters' user hooks, set aside for a step and called once at its end.

    params: name -> parameter whose .grad the step computes; not_whole: name -> why its .grad
    on this rank is not the whole gradient (its hooks are refused).
    """

    def __init__(self, params: Dict[str, torch.nn.Parameter], not_whole: Dict[str, str]):
        self.params = params
        self.not_whole = not_whole
        self.aside: List[Tuple[torch.nn.Parameter, Dict[int, Callable]]] = []
        # RemovableHandle.next_id when a scan last found no user hook (See NOTE: Hook
        # registrations counted, guards/modules.py): while it has not moved, no hook has been
        # registered since, and the step skips the scan of every parameter's table
        self.quiet: Optional[int] = None

    def set_aside(self) -> None:
        """Takes the user's hooks out of their parameters' hook tables for the step."""
        self.aside = []
        if self.quiet == RemovableHandle.next_id:
            return
        registered = RemovableHandle.next_id
        for name, p in self.params.items():
            table = p._post_accumulate_grad_hooks
            mine = {k: fn for k, fn in (table or {}).items() if not getattr(fn, _INTERNAL, False)}
            if not mine:
                continue
            if name in self.not_whole:
                self.restore()
                raise GraphcError(_refusal(name, next(iter(mine.values())), self.not_whole[name]))
            for k in mine:
                del table[k]
            self.aside.append((p, mine))
        self.quiet = registered if not self.aside else None

    def restore(self) -> List[Tuple[torch.nn.Parameter, Dict[int, Callable]]]:
        """Puts the hooks back, in the order they were registered (handle ids grow); returns
        what was set aside."""
        for p, mine in self.aside:
            table = p._post_accumulate_grad_hooks
            merged = sorted(list(table.items()) + list(mine.items()), key=lambda kv: kv[0])
            table.clear()
            table.update(merged)
        self.aside, aside = [], self.aside
        return aside

    def run(self) -> None:
        """Restores the hooks and calls each on its parameter, once, where .grad is final."""
        for p, mine in self.restore():
            if p.grad is None:  # no backward reached it this step: eager calls no hook either
                continue
            for _, fn in sorted(mine.items(), key=lambda kv: kv[0]):
                fn(p)


def _refusal(name: str, fn: Callable, why: str) -> str:
    return (f"parameter '{name}' has a post-accumulate-grad hook ({defined_at(fn)}), but {why}, so the hook cannot be called as eager calls it: once "
            "per step with the whole gradient in .grad. Fix: remove the hook (handle.remove()) "
            "and do its work on the whole model after the step (e.g. on graph.full_state_dict() "
            "or in the optimizer), or keep this parameter whole (no tensor-parallel split, no "
            "ZeRO, no set_param_dtype).")
