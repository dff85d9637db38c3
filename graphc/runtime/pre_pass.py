"""The plan's pre-pass on one rank: PrePass instructions (NOTE: Whole-batch sums, in
graphc/passes/feed_whole_sums.py).

Each PrePass runs its stage's Prologue on one micro-batch without gradient: the user inputs
of that micro-batch and what the earlier stages' pre-passes sent it (received as `RECV_P`,
or handed over in memory between this rank's own chunks) in, the sums to add up and the
values to send on (`SEND_P`) out. After the stage's last micro-batch the sums are totalled
(over the ranks of their groups too) and every micro-batch's forward reads the totals.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from ..plan.instructions import PRE, PrePass
from .executor import StageExecutor


class PrePasses:
    """Runs one rank's PrePass instructions; a step's running values live on the step."""

    def __init__(self, executors: Dict[int, StageExecutor], microbatches: int):
        self.executors, self.m = executors, microbatches
        # values between this rank's own chunks' pre-passes: stage -> [(consumer, names)]
        self.local: Dict[int, List[Tuple[int, List[str]]]] = {
            s: [(b, [t.name for t in specs]) for b, specs in sorted(ex.program.prologue.send_to.items())
                if b in executors]
            for s, ex in executors.items() if ex.program.prologue is not None and ex.program.prologue.in_plan}

    def run(self, ins: PrePass, step) -> None:
        """`step`: the runtime's StepValues (runtime/step_values.py: values, produced, pre_received, pre_sums)."""
        s, mb = ins.stage, ins.microbatch
        ex = self.executors[s]
        pro = ex.program.prologue
        values = {**step.values[(s, mb)], **step.pre_received.pop((s, mb), {})}
        outs = ex.prologue_microbatch(mb, values)
        step.pre_sums[s] = ex.prologue_sums(step.pre_sums.get(s) if mb else None, outs)
        sent = dict(zip(pro.sent, outs[len(pro.outputs):]))
        step.produced[(s, mb, PRE)] = sent   # what its SEND_Ps read
        for b, names in self.local[s]:
            step.pre_received[(b, mb)].update({n: sent[n] for n in names})
        if mb == self.m - 1:
            totals = ex.prologue_totals(step.pre_sums.pop(s))
            for k in range(self.m):
                step.values[(s, k)].update(totals)
