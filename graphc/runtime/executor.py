"""StageExecutor: runs one stage's program forward and backward, per micro-batch.

Backward uses PyTorch's autograd on the stage's own forward (per-stage autograd): the
kernels are exactly eager's, and parameter gradients accumulate in `.grad` across
micro-batches as in eager gradient accumulation. See docs/design.md.

A backward runs whole (`backward`) or split (`backward_input` then `backward_weight`, for
the zero-bubble schedules): the first computes only the gradients of the stage's inputs
(autograd prunes every path that does not lead to them) and keeps the graph; the second
computes the parameters' gradients from the same roots, then frees the graph. Each
gradient is computed by the same kernels as in a whole backward, so the numbers are the
same; the price is that W walks again the part of the graph I walked.

NOTE: Activation checkpointing
A checkpointed micro-batch runs its forward without recording autograd (torch.no_grad)
and keeps only its inputs, plus a copy of the stage's buffers when it has any. Its
backward first recomputes the forward, recording, with the buffers as they were at the
forward (then puts back their current values: a recompute updates no running statistic
twice) and inside the same random draw (ops/random_ops.py: masks are a pure function of
step and micro-batch), so every value, and therefore every gradient, is the forward's.
Compiled stages without buffers record the forward instead, their pieces saving only their
inputs and recomputing inside their compiled backward (NOTE: Recompute in compiled pieces).

Live activation bytes (only with `count_bytes`: config.set_memory_stats, since counting
runs a Python hook on every tensor autograd saves, ~2% of a step): every tensor autograd
saves during a forward is counted once (by storage) against its micro-batch until that
micro-batch's backward frees it; a checkpointed micro-batch counts its kept inputs.
`max_live_bytes` is the step's peak.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Dict, List, Optional, Tuple

import torch

from ..ops.conversions import all_reduce_sum
from ..plan.program import StageProgram
from ..ops.random_ops import drawing
from .compiled_recompute import recompute_in_backward
from .compiled_split import input_gradients_only
from .weight_grads import WeightGroups


class _Saved:
    """What a micro-batch keeps between its forward and its backward."""

    __slots__ = ("leaves", "outs", "inputs", "buffers", "versions", "nbytes", "roots", "grads", "weights")

    def __init__(self, leaves, outs, inputs=None, buffers=None, nbytes=0, versions=None):
        self.leaves, self.outs, self.inputs, self.buffers = leaves, outs, inputs, buffers
        self.versions = versions   # each buffer's version when `buffers` copied it
        self.nbytes = nbytes
        self.roots: Optional[list] = None   # set by backward_input for backward_weight
        self.grads: Optional[list] = None
        self.weights: Optional[WeightGroups] = None   # what W runs (NOTE: Weight gradients)


class StageExecutor:
    def __init__(self, program: StageProgram, training: bool, loss_scale: float,
                 checkpointed=frozenset(), count_bytes: bool = True):
        self.program = program
        self.count_bytes = count_bytes   # live activation bytes (see the module's docstring)
        self.training = training
        self.loss_scale = loss_scale
        self.checkpointed = frozenset(checkpointed)  # micro-batches whose forward is recomputed
        self.saved: Dict[int, _Saved] = {}
        self.max_live = 0
        self.live_bytes = 0
        self.max_live_bytes = 0
        self.draw = (0, 0)  # (base seed, step) random ops draw for (See NOTE: Replica-equal randomness)
        module = program.module
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._state = list(module.parameters()) + list(module.buffers())
        self._buffers = dict(module.named_buffers())
        # a memory probe's (NOTE: Measured peak memory): called with each activation autograd
        # saves (with count_bytes), and once a checkpointed micro-batch is recomputed
        self.watch_saved = self.recomputed = None
        self.units = None   # ZeRO stage 3 gathered per unit: a UnitGatherer (NOTE: ZeRO units)
        # what a forward calls: the program itself, or its compiled pieces (NOTE: Compiled stages)
        self.compute = module
        # compiled pieces recompute a checkpointed micro-batch inside their backward
        # (NOTE: Recompute in compiled pieces): its forward records, no recompute of ours
        self.recompute_inside = False

    # -- forward ---------------------------------------------------------------------
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
        if not self.training:
            with torch.no_grad(), drawing(*self.draw, mb):
                return dict(zip(prog.outputs, self.compute(*args)))
        # gathered per unit, the plan lists the recompute's gathers (NOTE: ZeRO units)
        inside = self.recompute_inside and self.units is None
        if mb in self.checkpointed and not inside:
            buffers = {n: b.clone() for n, b in self._buffers.items()} if self._buffers else None
            versions = {n: b._version for n, b in self._buffers.items()}
            with torch.no_grad(), drawing(*self.draw, mb):
                out = self.compute(*args)
            outs = dict(zip(prog.outputs, out))
            saved = _Saved(leaves, outs, args, buffers, self._bytes_of(args) if self.count_bytes else 0,
                           versions)
        else:
            seen: Dict[int, int] = {}
            count = self._counter(seen) if self.count_bytes else _identity
            saving = self._saving(count) if self.count_bytes or self.units is not None else nullcontext()
            with torch.enable_grad(), drawing(*self.draw, mb), saving, \
                    recompute_in_backward(mb in self.checkpointed):
                out = self.compute(*args)
            outs = dict(zip(prog.outputs, out))
            saved = _Saved(leaves, outs, nbytes=sum(seen.values()))
        self.saved[mb] = saved
        self.live_bytes += saved.nbytes
        self.max_live = max(self.max_live, len(self.saved))
        self.max_live_bytes = max(self.max_live_bytes, self.live_bytes)
        return outs

    def _saving(self, count):
        """Autograd's saved tensors counted (`count`) and, gathering per unit, those of a
        unit's parameters marked so that the backward makes the unit whole before reading
        them (NOTE: ZeRO units)."""
        if self.units is None:
            return torch.autograd.graph.saved_tensors_hooks(count, _identity)
        units = self.units

        def pack(t):
            marked = units.pack(t)
            return marked if marked is not t else count(t)
        return torch.autograd.graph.saved_tensors_hooks(pack, units.unpack)

    def computing(self, direction: str, mb: int):
        """The block of one compute: with units, their gathers and releases listed for it."""
        return nullcontext() if self.units is None else self.units.computing(direction, mb)

    @property
    def _fixed(self) -> set:
        """The storages of the stage's parameters and buffers, which are no activations: read
        now, since ZeRO stage 3 gives a parameter new storage at each gather (NOTE: ZeRO stage 3)."""
        return {t.untyped_storage().data_ptr() for t in self._state}

    def _counter(self, seen: Dict[int, int]):
        fixed = self._fixed

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in fixed and ptr not in seen:
                seen[ptr] = storage.nbytes()
                if self.watch_saved is not None:
                    self.watch_saved(t)
            return t
        return pack

    def _bytes_of(self, tensors) -> int:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tensors if isinstance(t, torch.Tensor)}
        return sum(n for p, n in storages.items() if p not in self._fixed)

    def prologue(self, per_mb: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """The program's per-step values: its prologue summed over the micro-batches' inputs,
        then over the ranks its inputs are split across (see plan.program.Prologue)."""
        sums = None
        for mb, values in enumerate(per_mb):
            sums = self.prologue_sums(sums, self.prologue_microbatch(mb, values))
        return self.prologue_totals(sums)

    def prologue_microbatch(self, mb: int, values: Dict[str, torch.Tensor]) -> tuple:
        """The prologue on one micro-batch's inputs (and received pre-pass values): its
        outputs to sum, then the values it sends on (Prologue.sent)."""
        pro = self.program.prologue
        with torch.no_grad(), drawing(*self.draw, mb):   # a pre-pass replays the micro-batch's draws
            return tuple(pro.module(*[values[name] for name in pro.inputs]))

    def prologue_sums(self, sums: Optional[list], outs: tuple) -> list:
        """`sums` with one micro-batch's summed outputs added (None: the first)."""
        outs = list(outs[:len(self.program.prologue.outputs)])
        return outs if sums is None else [a + b for a, b in zip(sums, outs)]

    def prologue_totals(self, sums: Optional[list]) -> Dict[str, torch.Tensor]:
        """The summed outputs over the micro-batches, summed over each one's rank groups."""
        pro = self.program.prologue
        return {name: all_reduce_sum(total, groups) if groups else total
                for name, total, groups in zip(pro.outputs, sums or [], pro.groups)}

    # -- backward --------------------------------------------------------------------
    def backward(self, mb: int, grads: List[Tuple[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """grads: (value name, gradient) received from consumer stages; returns input grads."""
        saved = self._pop(mb)
        roots, root_grads = self._roots(mb, saved, grads)
        if roots:
            with drawing(*self.draw, mb):
                torch.autograd.backward(roots, root_grads)
        return self._input_grads(saved)

    def backward_input(self, mb: int, grads: List[Tuple[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """Gradients of the stage's inputs only; the parameters' wait for backward_weight."""
        saved = self.saved[mb]
        roots, root_grads = self._roots(mb, saved, grads)
        saved.roots, saved.grads = roots, root_grads
        leaves = [t for t in saved.leaves.values()]
        if roots and self._params:
            saved.weights = WeightGroups.find(roots, leaves, self._params)
        if roots and leaves:
            weights = saved.weights
            if weights is not None:
                weights.keep()
            try:
                with drawing(*self.draw, mb), input_gradients_only():   # NOTE: Split compiled backward
                    got = torch.autograd.grad(roots, leaves, root_grads, retain_graph=True,
                                              allow_unused=True)
            finally:
                if weights is not None:
                    weights.release()
            return {name: (g if g is not None else torch.zeros_like(t))
                    for (name, t), g in zip(saved.leaves.items(), got)}
        return {name: torch.zeros_like(t) for name, t in saved.leaves.items()}

    def backward_weight(self, mb: int) -> None:
        """The parameters' gradients of micro-batch mb (after its backward_input)."""
        saved = self._pop(mb)
        if saved.roots and saved.weights is not None:
            # from where I left each parameter's branch (NOTE: Weight gradients); a parameter
            # the roots do not lead to simply gets no gradient
            with drawing(*self.draw, mb):
                saved.weights.run(saved.roots, saved.grads)
        saved.roots = saved.grads = saved.weights = None

    def _pop(self, mb: int) -> _Saved:
        saved = self.saved.pop(mb)
        self.live_bytes -= saved.nbytes
        return saved

    def _roots(self, mb: int, saved: _Saved, grads) -> Tuple[list, list]:
        if saved.inputs is not None:
            self._recompute(mb, saved)
        outs = saved.outs
        roots, root_grads = [], []
        if self.program.loss is not None:
            loss = outs[self.program.loss]
            roots.append(loss)
            root_grads.append(torch.full_like(loss, self.loss_scale))
        for name, g in grads:
            if outs[name].requires_grad:
                roots.append(outs[name])
                root_grads.append(g)
        return roots, root_grads

    def _recompute(self, mb: int, saved: _Saved) -> None:
        """The forward of a checkpointed micro-batch again, recording (NOTE: Activation
        checkpointing): same inputs, same buffers, same random draw."""
        current = versions = None
        if saved.buffers:
            current = {n: b.clone() for n, b in self._buffers.items()}
            # a buffer written since the forward (its version moved) is put back; an unchanged
            # one is left alone (see below). Versions, not torch.equal: no read on the host, which
            # on a GPU waits for the stream and cannot be captured (NOTE: CUDA graphs)
            with torch.no_grad():
                for n, b in self._buffers.items():
                    if b._version != saved.versions[n]:
                        b.copy_(saved.buffers[n])
            versions = {n: b._version for n, b in self._buffers.items()}
        recomputing = nullcontext() if self.units is None else self.units.recomputing_forward()
        count = self._counter({}) if self.count_bytes else _identity
        saving = self._saving(count) if self.count_bytes or self.units is not None else nullcontext()
        try:
            with torch.enable_grad(), drawing(*self.draw, mb), recomputing, saving:
                out = self.compute(*saved.inputs)
        finally:
            if current is not None:
                # only what the forward wrote (running statistics) goes back: a buffer it read
                # and autograd saved (a constant of positions an embedding looks up) must keep
                # its version, or the backward would refuse it as modified in place
                with torch.no_grad():
                    for n, b in self._buffers.items():
                        if b._version != versions[n]:
                            b.copy_(current[n])
        saved.outs = dict(zip(self.program.outputs, out))
        saved.inputs = saved.buffers = saved.versions = None
        if self.recomputed is not None:
            self.recomputed()

    @staticmethod
    def _input_grads(saved: _Saved) -> Dict[str, torch.Tensor]:
        return {name: (t.grad if t.grad is not None else torch.zeros_like(t))
                for name, t in saved.leaves.items()}

    @property
    def live(self) -> int:
        return len(self.saved)


def _identity(t):
    return t

