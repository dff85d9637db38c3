"""stage_inputs: random values for a stage program's inputs at one micro-batch's local shapes,
for the tools that run a program without its data (measured costs, the Prologue's cost,
the memory model's input bytes)."""
from __future__ import annotations

from typing import Dict

import torch


def stage_inputs(prog, compiled, fake: bool = False) -> Dict[str, torch.Tensor]:
    """Random values for every input of one stage's program, one micro-batch's local shapes."""
    from ..meta import META_SBP, META_TENSOR
    from ..sbp.layout import local_shape
    nodes = {n.name: n for n in compiled.gm.graph.nodes}
    nodes.update({n.name: n for n in prog.module.graph.nodes if n.op == "placeholder"
                  and n.name not in nodes})  # inputs a pass added to the program (a loss's count)
    received = {t.name: t for specs in prog.recv_from.values() for t in specs}
    values = {}
    for name in prog.inputs:
        if name in received:
            shape, dtype = received[name].shape, received[name].dtype
        else:  # a user input: this rank's component of one micro-batch
            meta, sig = nodes[name].meta[META_TENSOR], nodes[name].meta.get(META_SBP)
            shape = local_shape(meta.shape, sig.out, sig.mesh) if sig else meta.shape
            dtype = meta.dtype
        values[name] = _random(tuple(shape), getattr(torch, dtype))
    return values


def _random(shape, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)     # a valid class index / mask for any consumer
