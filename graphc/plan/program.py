"""StageProgram: the fx program one stage runs for one micro-batch, and its interface."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import torch.fx as fx

from ..sbp.pieces import Reshard
from .instructions import TensorSpec


@dataclass
class Prologue:
    """Values a stage computes once per step from the whole batch, before any micro-batch.

    `module(*inputs)` runs on each micro-batch's user inputs (named in `inputs`, as in the
    stage program) and returns one tensor per name in `outputs`. The runtime sums each over
    the micro-batches, then over the ranks of `groups[k]` (the mesh groups along which the
    k-th value's inputs are split across ranks; none: the sum is complete), and passes the
    totals to every micro-batch's forward as the program inputs of those names. Example: the
    whole batch's count of non-ignored targets of a token-mean loss (see feed_whole_batch).

    A pre-pass (feed_whole_sums, NOTE: Whole-batch sums) runs as plan instructions instead
    (`in_plan`: PrePass, one per micro-batch, before the schedule): its inputs may include
    values received from earlier stages' pre-passes (`recv_from`, producer stage -> values),
    and after the summed outputs the module returns the values later stages' pre-passes read
    (`send_to`, consumer stage -> values, in `sent` order), sent per micro-batch.
    """

    module: fx.GraphModule
    inputs: List[str]
    outputs: List[str]
    groups: List[Tuple[Tuple[int, ...], ...]]
    in_plan: bool = False
    sent: List[str] = field(default_factory=list)
    recv_from: Dict[int, List[TensorSpec]] = field(default_factory=dict)
    send_to: Dict[int, List[TensorSpec]] = field(default_factory=dict)


@dataclass
class StageProgram:
    """One stage's forward for one micro-batch.

    `module(*inputs)` takes the values named in `inputs` (user inputs and values received
    from earlier stages) and returns a tuple of the values named in `outputs`.
    """

    stage: int
    module: fx.GraphModule
    inputs: List[str]
    outputs: List[str]
    user_inputs: Dict[str, int]                      # input name -> index of build()'s argument
    recv_from: Dict[int, List[TensorSpec]]           # producer stage -> values received (forward)
    send_to: Dict[int, List[TensorSpec]]             # consumer stage -> values sent (forward)
    requires_grad: Dict[str, bool] = field(default_factory=dict)
    loss: Optional[str] = None                       # value whose backward starts on this stage
    loss_summed: bool = False                        # the loss is a batch sum (NOTE: Batch sums)
    results: List[str] = field(default_factory=list)  # build() outputs computed here
    whole_inputs: Tuple[str, ...] = ()               # user inputs not split into micro-batches
    prologue: Optional[Prologue] = None              # per-step values from the whole batch
    # value -> rank of its producing stage -> that rank's local shape, for the values crossing
    # a boundary whose shards differ by rank (NOTE: Uneven splits, docs/sbp.md)
    uneven: Dict[str, Dict[int, Tuple[int, ...]]] = field(default_factory=dict)
    # (value, receiving stage) -> how it moves between meshes of different shapes, in pieces
    # (NOTE: Reshard pieces, graphc/sbp/pieces.py); in the sender's and the receiver's program
    reshard: Dict[Tuple[str, int], Reshard] = field(default_factory=dict)

    def grad_specs(self, specs: List[TensorSpec]) -> List[TensorSpec]:
        """The subset of transferred values whose gradients flow back."""
        return [s for s in specs if self.requires_grad.get(s.name, False)]

    def specs_of(self, specs, producer: int) -> Tuple[TensorSpec, ...]:
        """`specs` as rank `producer` (the replica that computes the values) holds them: a
        value split unevenly has its own shape there, and so does its gradient."""
        if not self.uneven:
            return tuple(specs)
        return tuple(replace(s, shape=self.uneven[s.name][producer]) if s.name in self.uneven
                     else s for s in specs)

    def loss_weight(self, microbatches: int) -> float:
        """The seed of each micro-batch's backward: its part of a batch sum counts whole, its
        mean over its own rows 1/m of the step's mean (NOTE: Batch sums)."""
        return 1.0 if self.loss_summed else 1.0 / microbatches

    @property
    def code(self) -> str:
        return self.module.code

    def __str__(self) -> str:
        recv = {s: [str(t) for t in v] for s, v in self.recv_from.items()}
        send = {s: [str(t) for t in v] for s, v in self.send_to.items()}
        whole = f" whole_inputs={list(self.whole_inputs)}" if self.whole_inputs else ""
        summed = " (batch sum)" if self.loss_summed else ""
        head = (f"# stage {self.stage}: inputs={self.inputs} recv_from={recv} send_to={send} "
                f"loss={self.loss}{summed} results={self.results}{whole}")
        pro = self.prologue
        if pro is not None:
            where = "the plan's pre-pass (P)" if pro.in_plan else "once per step"
            moved = "".join(f" recv_from {a}: {[t.name for t in v]}" for a, v in sorted(pro.recv_from.items())) + \
                "".join(f" send_to {b}: {[t.name for t in v]}" for b, v in sorted(pro.send_to.items()))
            head += (f"\n# prologue ({where}, summed over micro-batches): "
                     f"{pro.outputs}{moved}\n{pro.module.code.strip()}")
        return f"{head}\n{self.module.code.strip()}"
