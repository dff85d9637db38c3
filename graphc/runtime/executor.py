"""StageExecutor: runs one stage's program forward and backward, per micro-batch.

Backward uses PyTorch's autograd on the stage's own forward (per-stage autograd): the
kernels are exactly eager's, and parameter gradients accumulate in `.grad` across
micro-batches as in eager gradient accumulation. See docs/design.md.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from ..plan.program import StageProgram
from .collectives import all_reduce_sum
from .rng import drawing


class StageExecutor:
    def __init__(self, program: StageProgram, training: bool, loss_scale: float):
        self.program = program
        self.training = training
        self.loss_scale = loss_scale
        self.saved: Dict[int, Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]] = {}
        self.max_live = 0
        self.draw = (0, 0)  # (base seed, step) random ops draw for (See NOTE: Replica-equal randomness)

    def forward(self, mb: int, values: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """values: every input of the program by name (user inputs and received values)."""
        prog = self.program
        leaves: Dict[str, torch.Tensor] = {}
        args = []
        for name in prog.inputs:
            t = values[name]
            if self.training and name not in prog.user_inputs and prog.requires_grad.get(name):
                t = t.detach().requires_grad_(True)
                leaves[name] = t
            args.append(t)
        with torch.set_grad_enabled(self.training), drawing(*self.draw, mb):
            out = prog.module(*args)
        outs = dict(zip(prog.outputs, out))
        if self.training:
            self.saved[mb] = (leaves, outs)
            self.max_live = max(self.max_live, len(self.saved))
        return outs

    def prologue(self, per_mb: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """The program's per-step values: its prologue summed over the micro-batches' inputs,
        then over the ranks its inputs are split across (see plan.program.Prologue)."""
        pro = self.program.prologue
        with torch.no_grad():
            sums = None
            for values in per_mb:
                outs = pro.module(*[values[name] for name in pro.inputs])
                sums = list(outs) if sums is None else [a + b for a, b in zip(sums, outs)]
            return {name: all_reduce_sum(total, groups) if groups else total
                    for name, total, groups in zip(pro.outputs, sums, pro.groups)}

    def backward(self, mb: int, grads: List[Tuple[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """grads: (value name, gradient) received from consumer stages; returns input grads."""
        leaves, outs = self.saved.pop(mb)
        roots, root_grads = [], []
        if self.program.loss is not None:
            loss = outs[self.program.loss]
            roots.append(loss)
            root_grads.append(torch.full_like(loss, self.loss_scale))
        for name, g in grads:
            if outs[name].requires_grad:
                roots.append(outs[name])
                root_grads.append(g)
        if roots:
            torch.autograd.backward(roots, root_grads)
        return {name: (t.grad if t.grad is not None else torch.zeros_like(t))
                for name, t in leaves.items()}

    @property
    def live(self) -> int:
        return len(self.saved)
