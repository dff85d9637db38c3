"""torch.utils.checkpoint inside build() or a model's forward traces as the function it wraps.

Used by trace_build while it traces: `with traced_checkpoints(tracer): ...`.

Both of torch's forms break a symbolic trace: `use_reentrant=True` is an autograd Function
whose argument is a Python callable (fx cannot record it, and its forward runs the callable
outside the trace), `use_reentrant=False` saves its inputs through autograd's C++ hooks,
which a proxy is not. A checkpoint changes what autograd keeps, not what is computed, so
graphc records the wrapped function's ops inline: forward values and gradients are eager's.
Recomputation (the memory saving) is graphc's own: config.set_activation_checkpointing,
per module or graph-wide (NOTE: Activation checkpointing in runtime/executor.py); a
warning says so once per trace.

One behaviour of the reentrant form is kept: when none of its tensor inputs requires grad
(a checkpointed first layer fed the raw batch), its outputs do not either, so the wrapped
parameters get no gradient in eager ("None of the inputs have requires_grad=True"); the
traced outputs are detached in that case.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List

import torch
import torch.fx as fx
import torch.utils.checkpoint as torch_checkpoint

from ..errors import GraphcError
from ..log import warn_user
from .user_lines import caller_line


@contextmanager
def traced_checkpoints(tracer) -> Iterator[None]:
    """While tracing, a checkpoint called on traced values records its function's ops inline."""
    cls = torch_checkpoint.CheckpointFunction
    had_apply = "apply" in cls.__dict__
    saved_apply = cls.__dict__.get("apply")
    saved_generator = torch_checkpoint._checkpoint_without_reentrant_generator
    lines: List[str] = []

    def reentrant(cls_, function, preserve_rng_state, *args):
        if not _traced(args):
            return torch.autograd.Function.apply.__func__(cls_, function, preserve_rng_state, *args)
        lines.append(caller_line(None))
        out = function(*args)
        if any(_requires_grad(tracer, a) for a in args):
            return out
        return fx.node.map_aggregate(out, lambda v: v.detach() if isinstance(v, fx.Proxy) else v)

    def non_reentrant(function, preserve_rng_state, context_fn, determinism_check, debug,
                      early_stop, *args, **kwargs):
        if not _traced((args, kwargs)):
            yield from saved_generator(function, preserve_rng_state, context_fn, determinism_check,
                                       debug, early_stop, *args, **kwargs)
            return
        lines.append(caller_line(None))
        yield  # checkpoint() runs function(*args, **kwargs) here, traced as any other code

    cls.apply = classmethod(reentrant)
    torch_checkpoint._checkpoint_without_reentrant_generator = non_reentrant
    try:
        yield
    finally:
        if had_apply:
            cls.apply = saved_apply
        else:
            del cls.apply
        torch_checkpoint._checkpoint_without_reentrant_generator = saved_generator
    if lines:
        warn_user(f"graphc: torch.utils.checkpoint at {lines[0]}"
                  f"{f' (and {len(lines) - 1} more)' if len(lines) > 1 else ''} is traced as the "
                  "function it wraps: values and gradients are eager's, but graphc does not "
                  "recompute it. For the memory saving, set graphc's activation checkpointing: "
                  "graph.model.<module>.config.set_activation_checkpointing(True), or "
                  "self.config.set_activation_checkpointing(\"always\") in the Graph's __init__.")


def _traced(values) -> bool:
    found = []
    fx.node.map_aggregate(values, lambda v: found.append(v) if isinstance(v, fx.Proxy) else v)
    return bool(found)


def _requires_grad(tracer, value) -> bool:
    """Whether a checkpoint input requires grad as in eager: a traced value's fake says."""
    if isinstance(value, fx.Proxy):     # before Tensor: a proxy reads as a Tensor
        try:
            fake = tracer.fake_of(value)
        except GraphcError:             # unknown here; propagate_shapes reports it
            return True
        return isinstance(fake, torch.Tensor) and fake.requires_grad
    return isinstance(value, torch.Tensor) and value.requires_grad

