"""A stage-3 parameter read between graph calls (its storage freed: it crashed the process) is
a GraphcError naming the parameter, the user's line and the fix; its metadata reads pass, and
training goes on equal to eager PyTorch in float64 at 1e-10 (helpers.py). In the one-process
local world, data 2, per unit. See NOTE: ZeRO-3 parameters between calls in
graphc/runtime/zero_access.py.
"""
import copy

import pytest
import torch

import graphc
import graphc.testing
from graphc.runtime.zero_access import HeldParameter
from helpers import assert_same_as_eager
from models import OPTIMIZERS
from test_zero3_units import UnitGraph
from test_zero_numerics import Net, batches, eager, rows


def _reads_refused(graph) -> list:
    """Each read of fc1.weight between calls refused (as its message), metadata read."""
    w = graph.model.fc1.weight
    assert type(w) is HeldParameter and isinstance(w, torch.nn.Parameter)
    assert (tuple(w.shape), w.dtype, w.requires_grad, w.numel()) == ((33, 16), torch.float64, True, 33 * 16)
    said = []
    for read in (lambda: w.clone(), lambda: repr(w), lambda: w.data, lambda: w + 1,
                 lambda: graph.model.state_dict(), lambda: copy.deepcopy(graph.model)):
        with pytest.raises(graphc.GraphcError, match=r"'model\.fc1\.weight'.*full_state_dict") as e:
            read()
        said.append(str(e.value))
    return said


def test_reading_a_stage_3_parameter_between_calls_is_refused_and_training_goes_on():
    where = graphc.placement("cpu", [0, 1])
    data = batches()
    graphs, said = {}, {}

    def make(rank):
        torch.manual_seed(0)
        model = graphc.to_global(Net(), placement=where, sbp=graphc.sbp.broadcast)
        graphs[rank] = UnitGraph(model, OPTIMIZERS["adam"](model.parameters()))
        return graphs[rank]

    def inputs(rank, step):
        if step == 1:     # between the first call and the second, on every rank
            said[rank] = _reads_refused(graphs[rank])
        x, y = data[step]
        return (graphc.to_global(rows(x, rank, 2), placement=where, sbp=graphc.sbp.split(0)),
                graphc.to_global(rows(y, rank, 2), placement=where, sbp=graphc.sbp.split(0)))

    run = graphc.testing.local_world(make, inputs, 2, steps=len(data))
    ref_losses, ref_state = eager("adam", False)
    assert_same_as_eager(run.losses, run.state, ref_losses, ref_state, "reads refused between calls")
    assert sorted(said) == [0, 1]
    assert "test_zero3_access.py" in said[0][0] and "(clone)" in said[0][0]
    assert "(.data)" in said[0][2]
