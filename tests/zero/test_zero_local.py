"""ZeRO stages 1 and 2 in a local world (graphc.testing.local_world: every rank a thread of
this process, the same plans and runtime) equal eager on the whole batch in float64 at 1e-10:
the one-process check of tests/zero/test_zero_numerics.py's data-parallel runs (data 2 and
4, the uneven and 3-row weights, Adam, accumulation 4, clipping)."""
import pytest

import graphc
import graphc.testing
from graphc.plan.instructions import ReduceScatter
from helpers import assert_same_as_eager
from models import OPTIMIZERS
from test_zero_numerics import Net, ZeroGraph, batches, eager, rows


@pytest.mark.parametrize("world,stage", [(2, 1), (4, 2)])
def test_zero_in_a_local_world_equals_eager(world, stage):
    where = graphc.placement("cpu", list(range(world)))
    data = batches()

    def make():
        import torch
        torch.manual_seed(0)
        model = graphc.to_global(Net(), placement=where, sbp=graphc.sbp.broadcast)
        return ZeroGraph(model, OPTIMIZERS["adam"](model.parameters()), stage, 4, True)

    def inputs(rank, step):
        x, y = data[step]
        return (graphc.to_global(rows(x, rank, world), placement=where, sbp=graphc.sbp.split(0)),
                graphc.to_global(rows(y, rank, world), placement=where, sbp=graphc.sbp.split(0)))

    run = graphc.testing.local_world(make, inputs, world, steps=len(data))
    assert any(isinstance(i, ReduceScatter) for i in run.graphs[0].plan.instructions)
    ref_losses, ref_state = eager("adam", True)
    assert_same_as_eager(run.losses, run.state, ref_losses, ref_state, f"local data {world} zero {stage}")
