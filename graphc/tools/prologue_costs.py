"""What a stage's Prologue costs per step, for the simulator.

NOTE: Prologue costs
A stage whose program has a Prologue (plan/program.py: the whole batch's token count of a
token-mean loss, passes/feed_whole_batch.py; whole-batch sums, feed_whole_sums.py) runs it
once per step before its plan's first instruction, outside the plan
(Runtime._microbatches): the module on each micro-batch's inputs, then one blocking
all-reduce per value whose inputs are split over ranks. Every data-parallel rank of a
cross-entropy loss pays it each step: on 2 gloo ranks of benchmarks/simulator_accuracy.py's
data layout, timing StageExecutor.prologue measured a median 16-17 ms (least 5.7 ms) of a
255-277 ms step at load 5-8, a cost the simulator did not see. The simulator now charges
it at the start of each rank's step (CostModel.step_start: in the event engine before the
step's first instruction, and in a rank's work where ranks share cores, NOTE: Shared cores):
the module's time, replayed with its stage (measure_costs) or modelled (device_costs: its
ops' host time; its FLOPs are negligible), and each all-reduce as a collective of that
value's bytes over the rank's group (CostModel.collective). On a simulated timeline it is
the gap before a step's first span.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from .cost_model import PrologueCost


def prologue_costs(compiled, seconds: Dict[int, float]) -> Dict[int, PrologueCost]:
    """stage -> PrologueCost for the stages with a Prologue; `seconds`: stage -> its module's
    time per step (all micro-batches), measured or modelled."""
    out = {}
    for prog in compiled.programs:
        pro = prog.prologue
        if pro is None:
            continue
        _, nbytes = prologue_ops_and_bytes(prog, compiled)
        reduces = tuple((tuple(tuple(g) for g in groups), n)
                        for groups, n in zip(pro.groups, nbytes) if groups)
        out[prog.stage] = PrologueCost(seconds.get(prog.stage, 0.0), reduces)
    return out


def prologue_ops_and_bytes(prog, compiled) -> Tuple[int, List[int]]:
    """(ops the Prologue dispatches per step, over every micro-batch; bytes of each value it
    returns), counted on fake tensors of one micro-batch's shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from ..ops.conversions import shapes_only
    from .stage_inputs import stage_inputs
    from .flops import CountFlops
    pro = prog.prologue
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = stage_inputs(prog, compiled)
        counter = CountFlops()
        with counter, shapes_only(compiled.stages[prog.stage].ranks[0]):
            outs = pro.module(*[inputs[name] for name in pro.inputs])
    return counter.flops.ops * compiled.num_microbatches, [t.numel() * t.element_size() for t in outs]
