"""What graphc's once-per-call optimizer and LR scheduler steps cannot drive (add_optimizer)."""
from __future__ import annotations

import torch

from ..errors import GraphcError


def check_optimizer(optimizer: torch.optim.Optimizer, lr_sch) -> None:
    """What the runtime's once-per-call opt.step() and lr_sch.step() cannot drive."""
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.LBFGS):
        raise GraphcError(
            f"add_optimizer: {name} needs a closure (step(closure) re-evaluates the loss several "
            "times per step), but graphc calls optimizer.step() once per call with the "
            "accumulated gradients. Fix: use an optimizer whose step() takes no closure "
            "(SGD, Adam, AdamW, ...).")
    if lr_sch is None:
        return
    sch = type(lr_sch).__name__
    if isinstance(lr_sch, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise GraphcError(
            f"add_optimizer: lr_sch is a {sch}, whose step(metric) needs a metric (e.g. the "
            "validation loss) that graphc does not have when it steps the scheduler once per "
            "call. Fix: leave lr_sch out and call lr_sch.step(metric) yourself after the graph's "
            "call (or after each epoch), or pass a scheduler without a metric (StepLR, "
            "CosineAnnealingLR, LambdaLR, ...).")
    if not isinstance(lr_sch, torch.optim.lr_scheduler.LRScheduler):
        raise GraphcError(
            f"add_optimizer: lr_sch must be a torch.optim.lr_scheduler.LRScheduler, found {sch}. "
            "Fix: pass a scheduler built on this optimizer, e.g. "
            "lr_sch=torch.optim.lr_scheduler.StepLR(opt, step_size=10), or leave it out.")
    if getattr(lr_sch, "optimizer", optimizer) is not optimizer:
        raise GraphcError(
            f"add_optimizer: lr_sch ({sch}) was built on another optimizer "
            f"({type(lr_sch.optimizer).__name__}) than the {name} given, so stepping it would "
            "not change this optimizer's learning rate. Fix: build the scheduler on the "
            "optimizer you pass to add_optimizer.")
