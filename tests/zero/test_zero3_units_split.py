"""ZeRO stage 3 per unit on split-backward schedules (ZB-V, zero_bubble): each compute, the
input half I and the weight half W of a backward included, gathers and frees the units it
reads (W runs the nodes that lead to the parameters again, which read them), and equals eager
PyTorch on the whole batch in float64 at 1e-10 (helpers.py), in the one-process local world on
pipeline 2 x data 2. See NOTE: ZeRO units in graphc/runtime/zero_units.py.
"""
import pytest
import torch

import graphc
import graphc.testing
from graphc.plan.instructions import (AllGather, BackwardInput, BackwardWeight, ReleaseParams,
                                      UnitGather, parse_instruction)
from graphc.plan.plan import ExecutionPlan
from helpers import assert_same_as_eager
from models import OPTIMIZERS
from test_zero3_units import UnitGraph
from test_zero_numerics import Net, batches, eager, rows


class SplitUnitGraph(UnitGraph):
    """ZB-V (DualPipeV alike): stages 0 (fc1) and 3 (head) on ranks 0, 1, stages 1 (norm) and
    2 (fc2) on ranks 2, 3; zero_bubble: fc1 and norm on ranks 0, 1, fc2 and head on ranks 2, 3.
    Each data 2."""

    def __init__(self, model, opt, schedule, accumulation, clip, checkpointing="never"):
        super().__init__(model, opt, accumulation, clip=clip, checkpointing=checkpointing)
        first, second = graphc.placement("cpu", [0, 1]), graphc.placement("cpu", [2, 3])
        v, loop = [first, second, second, first], [first, first, second, second]
        where = {"zbv": v, "dualpipev": v, "zero_bubble": loop}[schedule]
        stages = {"zbv": [0, 1, 2, 3], "dualpipev": [0, 1, 2, 3], "zero_bubble": [0, 0, 1, 1]}[schedule]
        for module, s, p in zip([self.model.fc1, self.model.norm, self.model.fc2, self.model.head], stages, where):
            module.config.set_stage(s, p)
        self.config.set_pipeline_schedule(schedule)


@pytest.mark.parametrize("schedule,accumulation,clip,checkpointing", [
    ("zbv", 2, False, "never"),
    pytest.param("zbv", 4, True, "always", marks=pytest.mark.slow),          # CI time
    pytest.param("zero_bubble", 2, False, "never", marks=pytest.mark.slow)])
def test_units_on_split_backward_schedules_equal_eager(schedule, accumulation, clip, checkpointing):
    data = batches()
    x_at = graphc.placement("cpu", [0, 1])
    y_at = x_at if schedule == "zbv" else graphc.placement("cpu", [2, 3])   # the loss's stage

    def make():
        torch.manual_seed(0)
        model = Net()
        return SplitUnitGraph(model, OPTIMIZERS["adam"](model.parameters()), schedule, accumulation,
                              clip, checkpointing)

    def inputs(rank, step):
        x, y = data[step]
        return (graphc.to_global(rows(x, rank % 2, 2), placement=x_at, sbp=graphc.sbp.split(0)),
                graphc.to_global(rows(y, rank % 2, 2), placement=y_at, sbp=graphc.sbp.split(0)))

    run = graphc.testing.local_world(make, inputs, 4, steps=len(data))
    ref_losses, ref_state = eager("adam", clip)
    what = f"units, {schedule}, accumulation {accumulation}, clip {clip}, checkpointing {checkpointing}"
    assert_same_as_eager(run.losses, run.state, ref_losses, ref_state, what)
    for graph in run.graphs:
        plan = graph.plan
        assert not any(type(i) in (AllGather, ReleaseParams) for i in plan.instructions), str(plan)
        assert any(isinstance(i, (BackwardInput, BackwardWeight)) for i in plan.instructions)
        for ins in plan.instructions:
            assert parse_instruction(str(ins)) == ins
        assert ExecutionPlan.from_json(plan.to_json()).instructions == plan.instructions
    # fc2 and head are read by both halves of their backward (fc1 by none: linear in its weight
    # on the batch, which needs no gradient)
    halves = {i.direction for g in run.graphs for i in g.plan.instructions if isinstance(i, UnitGather)}
    assert halves == {"F", "I", "W"}
