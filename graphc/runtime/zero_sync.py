"""ZeRO's gradient synchronisation: the REDUCE_SCATTER buckets launched from the backward's
hooks, beside data parallelism's all-reduces (See NOTE: ZeRO in zero.py, NOTE: ZeRO rows as
gradients are final in zero_rows.py)."""
from __future__ import annotations

from typing import Dict, Set

import torch

from ..plan.instructions import ReduceScatter
from .collectives import GradSync
from .zero import ZeroShards
from .zero_rows import ReducedRows, row_grad


class ZeroGradSync(GradSync):
    """GradSync whose REDUCE_SCATTER buckets go through ZeroShards (all-reduces and ties as
    GradSync's); launched in plan order with them, from the same hooks."""

    SYNCS = GradSync.SYNCS + (ReduceScatter,)

    @classmethod
    def for_shards(cls, plan, programs, shards: ZeroShards, masters=None) -> "ZeroGradSync":
        sync = cls.from_plan(plan, programs, masters)
        sync.shards = shards
        sync.scatters = {i: ins for ins, i in sync.index.items() if isinstance(ins, ReduceScatter)}
        sync.packed: Dict[int, torch.Tensor] = {}
        sync.step_now = None   # (ReduceScatter) -> None: steps a bucket once reduced (NOTE: ZeRO units)
        sync.scattered = None  # (ReduceScatter) -> None: a bucket's gradients are final, launched
        # at most this many reduce-scatters in flight (None: any); launching one more finishes
        # the oldest, so its packed bucket (its gradients' size) is freed inside the backward
        sync.in_flight = None
        # buckets reduced rank by rank, launched parameter by parameter as their gradients
        # are final (NOTE: ZeRO rows as gradients are final)
        sync.by_rows = {i for i, ins in sync.scatters.items()
                        if not sync.deferred[i] and shards.reduces_rows(ins, sync.buckets[i][1])}
        sync.final: Set[int] = set()
        sync.started: Dict[int, ReducedRows] = {}
        return sync

    def start_step(self) -> None:
        super().start_step()
        self.final, self.started = set(), {}

    def _final(self, key: int) -> None:
        self.final.add(key)
        self._launch_final_rows()

    def _launch_final_rows(self) -> None:
        """The next bucket's parameters whose gradients are final, in its order, up to the first
        that is not, launched (NOTE: ZeRO rows as gradients are final); the bucket itself is
        launched (_launch) once all are."""
        i = self.next
        if i not in self.by_rows:
            return
        params = self.buckets[i][1]
        rows = self.started.get(i)
        if rows is None:
            rows = self.started[i] = self.shards.start_rows(self.scatters[i], params)
        while rows.launched < len(params) and id(params[rows.launched]) in self.final:
            rows.launch_next(row_grad(params[rows.launched]))

    def _launch(self, i: int) -> None:
        ins = self.scatters.get(i)
        if ins is None:
            super()._launch(i)
            self._launch_final_rows()
            return
        work, out, packed = self.shards.scatter(ins, self.buckets[i][1], self.packed.get(i),
                                                self.started.pop(i, None))
        if self.shards.stage == 1:   # kept between steps, as DDP's buckets
            self.packed[i] = packed
        self.works[i] = (work, out, packed)   # packed: alive until the work is done
        self.next = i + 1
        if self.scattered is not None:
            self.scattered(ins)
        if self.in_flight is not None:
            flying = sorted(j for j in self.works if j in self.scatters)
            for j in flying[:-self.in_flight]:
                self._finish(j)
        self._launch_final_rows()

    def finish_flying(self) -> None:
        """Finishes every reduce-scatter launched (gathered per unit: when the backward reaches
        the next unit, before its gradient exists; NOTE: ZeRO units)."""
        for j in sorted(j for j in self.works if j in self.scatters):
            self._finish(j)

    def wait(self, ins) -> None:
        if not isinstance(ins, ReduceScatter):
            return super().wait(ins)
        i = self.index[ins]
        while self.next <= i:
            self._launch(self.next)
        if i in self.works:          # (else finished already, inside the backward)
            self._finish(i)
        if not self.works:
            self.armed = False

    def _finish(self, i: int) -> None:
        """Waits for bucket i's reduce-scatter; this rank's sum becomes its shards' gradients."""
        ins = self.scatters[i]
        work, out, _ = self.works.pop(i)
        if work is not None:
            work.wait()
        kept = self.packed.get(i)
        if kept is not None and kept.dtype == out.dtype:
            # stage 1 keeps the packed bucket: this rank's sum goes into its own row there, and
            # the shards' gradients are views of it (no buffer of their own: Megatron's layout)
            row = kept[self.shards.by_name[ins.tensors[0].name].ranks.index(self.shards.rank)]
            row.copy_(out)
            out = row
        self.shards.take_grads(ins, out)
        if self.step_now is not None:
            self.step_now(ins)
