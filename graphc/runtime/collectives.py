"""Gradient synchronisation: bucketed all-reduces of partial_sum and tied gradients.

The collectives a stage program itself calls (`box`, the group registry) are in
graphc/ops/conversions.py.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .. import world
from ..plan.instructions import AllReduce, TieAllReduce
from ..ops.conversions import my_group
from .grad_hooks import internal

# -- gradient synchronisation ----------------------------------------------------------------
class GradSync:
    """Bucketed all-reduce of partial_sum gradients, and of tied parameters' gradients among
    the stages holding them (TieAllReduce, a bucket of its own), launched as soon as they
    are final.

    A hook on every parameter counts its gradient accumulations in the step; a parameter is
    final after `expected` of them (one per micro-batch and per local stage program that
    uses it: a rank holding two chunks that share a parameter accumulates it from both). A
    bucket's all-reduce starts (async) once all its gradients are final, overlapping the
    rest of the backward, whatever the schedule's order of chunks and micro-batches.
    `wait(ins)` finishes an AllReduce instruction's bucket (launching it first if its hooks
    did not fire, e.g. unused parameters). Buckets launch in plan order on every rank.

    NOTE: Gradient reduce dtype
    A bucket is summed in the dtype its instruction's TensorSpecs name (insert_grad_sync:
    config.set_grad_reduce_dtype, else the gradients' own): each rank casts its gradients
    (its addends, accumulated in their own dtype over the micro-batches) into a flat bucket
    of that dtype, the all-reduce sums it there, and the sum is cast back into a bucket of
    the gradients' dtype whose views become the .grad. Only the sum over ranks is rounded.
    """

    def __init__(self, buckets: List[Tuple[Tuple[int, ...], List[torch.nn.Parameter]]],
                 expected: Optional[Dict[int, int]] = None,
                 dtypes: Optional[List[Optional[torch.dtype]]] = None,
                 hooked: Optional[Dict[int, torch.Tensor]] = None):
        self.buckets = buckets
        self.dtypes = dtypes or [None] * len(buckets)   # per bucket: summed in (None: the grads')
        self.armed = False
        self.remaining: List[int] = []
        self.works: Dict[int, Tuple[object, torch.Tensor]] = {}
        self.handles = []
        self.next = 0
        self.early = 0                      # buckets of the last step launched by hooks
        self.flats: Dict[int, torch.Tensor] = {}
        self.wides: Dict[int, torch.Tensor] = {}   # a bucket's sum back in the gradients' dtype
        self.carried: Dict[int, torch.Tensor] = {}
        self.last_of = {id(p): i for i, (_, params) in enumerate(buckets) for p in params}
        self.index: Dict[object, int] = {}
        self.expected = expected or {}      # id(param) -> accumulations per step (default 1)
        self.count: Dict[int, int] = {}
        # a gradient partial on two mesh axes is reduced over one, then the other: a bucket
        # holding a gradient of an earlier bucket starts only once that one is back (wait)
        seen: set = set()
        self.deferred = []
        self.in_buckets: Dict[int, List[int]] = {}
        for i, (_, params) in enumerate(buckets):
            self.deferred.append(any(id(p) in seen for p in params))
            seen |= {id(p) for p in params}
            for p in params:
                self.in_buckets.setdefault(id(p), []).append(i)
        # a float32 master's gradient is final when its bf16 parameter's accumulation hook ran
        # (NOTE: Master parameters): hooked maps id(master) -> that parameter
        hooked = hooked or {}
        by_id = {id(p): p for _, params in buckets for p in params}
        for key, p in by_id.items():
            self.handles.append(hooked.get(key, p).register_post_accumulate_grad_hook(self._hook(key)))

    SYNCS = (AllReduce, TieAllReduce)   # the instructions whose buckets it launches

    @classmethod
    def from_plan(cls, plan, programs, masters=None) -> "GradSync | None":
        # gradient all-reduces and ties (not ClipGradNorm); a tie names its parameters as
        # this rank's stage programs know them. With masters (set_param_dtype) the buckets
        # hold the float32 masters, whose .grad the parameters' hooks fill
        syncs = [ins for ins in plan.instructions if type(ins) in cls.SYNCS]
        if not syncs or not programs:
            return None
        params: Dict[str, torch.nn.Parameter] = {}
        uses: Dict[int, int] = {}
        for prog in programs:
            for name, p in prog.module.named_parameters(remove_duplicate=False):
                params.setdefault(name, p)
            for p in {id(p): p for p in prog.module.parameters()}.values():
                uses[id(p)] = uses.get(id(p), 0) + 1
        names = [ins.params if isinstance(ins, TieAllReduce) else [t.name for t in ins.tensors]
                 for ins in syncs]
        m = plan.num_microbatches
        held = masters.master_of if masters is not None else (lambda p: p)
        hooked = {id(held(p)): p for p in params.values()}
        sync = cls([(ins.ranks, [held(params[n]) for n in ns]) for ins, ns in zip(syncs, names)],
                   {id(held(p)): m * uses[id(p)] for p in params.values()},
                   [getattr(torch, ins.tensors[0].dtype) if ins.tensors else None for ins in syncs],
                   hooked)
        sync.index = {ins: i for i, ins in enumerate(syncs)}
        return sync

    def _hook(self, key: int):
        @internal  # per micro-batch, beside the user's hooks (NOTE: Post-accumulate-grad hooks)
        def fire(_param):
            if not self.armed:
                return
            self.count[key] = self.count.get(key, 0) + 1
            if self.count[key] != self.expected.get(key, 1):
                return  # more micro-batches (or chunks) still add to this gradient
            for i in self.in_buckets[key]:
                self.remaining[i] -= 1
            self._final(key)
            # launch in bucket order on every rank: collectives on a group must match
            while (self.next < len(self.buckets) and self.remaining[self.next] == 0
                   and not self.deferred[self.next]):
                self.early += 1  # started inside the backward: overlaps the rest of it
                self._launch(self.next)
        return fire

    def _final(self, key: int) -> None:
        """The gradient of id `key` is final in this step (before its bucket may be): a
        subclass may start on it (ZeroGradSync: NOTE: ZeRO rows as gradients are final)."""

    def start_step(self) -> None:
        """Before a step's first backward: set aside gradients left from earlier steps (no
        optimizer zeroed them), so only this step's partial sums are all-reduced; count
        this step's accumulations from zero."""
        self.carried = {}
        for _, params in self.buckets:
            for p in params:
                if p.grad is not None and id(p) not in self.carried:
                    self.carried[id(p)] = p.grad.clone()  # it may view a reused bucket
                    p.grad = None
        self.armed = True
        self.count = {}
        self.remaining = [len(params) for _, params in self.buckets]
        self.works = {}
        self.next = 0
        self.early = 0

    def _launch(self, i: int) -> None:
        ranks, params = self.buckets[i]
        group, _, n = my_group((ranks,))
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        dtype = self.dtypes[i] or grads[0].dtype
        flat = self.flats.get(i)  # reused every step: no fresh bucket-sized allocation
        if flat is None or flat.dtype != dtype or flat.device != grads[0].device:
            flat = self.flats[i] = torch.empty(sum(g.numel() for g in grads), dtype=dtype,
                                               device=grads[0].device)
        torch.cat(grads, out=flat)  # cast to the reduce dtype on the way in (NOTE above)
        work = world.current().all_reduce(flat, group, async_op=True) if n > 1 else None
        self.works[i] = (work, flat)
        self.next = i + 1

    def wait(self, ins) -> None:
        """Finishes the bucket of AllReduce instruction `ins` (launching any not yet started)."""
        i = self.index[ins]
        while self.next <= i:
            self._launch(self.next)
        work, flat = self.works.pop(i)
        if work is not None:
            work.wait()
        flat = self._widened(i, flat)
        offset = 0
        for p in self.buckets[i][1]:  # the reduced gradients are views of the bucket: no copy
            numel = p.numel()
            p.grad = flat[offset:offset + numel].view_as(p)
            if i == self.last_of.get(id(p)) and id(p) in self.carried:
                p.grad = p.grad + self.carried.pop(id(p))
            offset += numel
        if not self.works:
            self.armed = False

    def _widened(self, i: int, flat: torch.Tensor) -> torch.Tensor:
        """Bucket i's sum in its gradients' dtype (itself when it was summed in it)."""
        dtype = self.buckets[i][1][0].dtype
        if flat.dtype == dtype:
            return flat
        wide = self.wides.get(i)
        if wide is None or wide.shape != flat.shape or wide.device != flat.device or wide.dtype != dtype:
            wide = self.wides[i] = torch.empty(flat.shape, dtype=dtype, device=flat.device)
        return wide.copy_(flat)


# -- build()'s partial_sum results ---------------------------------------------------------
class OutputSums:
    """The OutputAllReduce instructions of a step (See insert_output_reduce): each launches
    one all-reduce of its results' per-micro-batch values, stacked, without waiting;
    `finish` waits for them when the step ends and puts the sums back in the results."""

    def __init__(self):
        self.pending: List[Tuple[object, torch.Tensor, List[str], List[int]]] = []

    def launch(self, ins, results: Dict[str, List[torch.Tensor]]) -> None:
        names = [t.name for t in ins.tensors]
        if any(name in pending_names for _, _, pending_names, _ in self.pending for name in names):
            self.finish(results)   # a result partial on two mesh axes: one axis's sum, then the next
        rows = [torch.stack(results[name]) for name in names]
        flat = torch.cat([r.reshape(-1) for r in rows])
        group, _, n = my_group((tuple(ins.ranks),))
        work = world.current().all_reduce(flat, group, async_op=True) if n > 1 else None
        self.pending.append((work, flat, names, [r.numel() for r in rows]))

    def finish(self, results: Dict[str, List[torch.Tensor]]) -> None:
        for work, flat, names, sizes in self.pending:
            if work is not None:
                work.wait()
            for name, part in zip(names, flat.split(sizes)):
                before = results[name]
                results[name] = list(part.view((len(before),) + before[0].shape).unbind(0))
        self.pending = []
