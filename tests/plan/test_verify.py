"""The plan verifier catches injected faults and names the rank and instruction."""
import copy

import pytest
import torch

from graphc import compiler
from graphc.errors import PlanError
from graphc.plan.instructions import Recv, TensorSpec
from graphc.plan.verify import verify_plans
from models import PipelineGraph, SkipNet


def plans(p=2, m=4, schedule="1f1b"):
    g = PipelineGraph(SkipNet(p), None, accumulation=m, schedule=schedule)
    return compiler.compile(g, [torch.randn(4 * m, 16), torch.randint(0, 5, (4 * m,))], p).plans


@pytest.mark.parametrize("p,m,schedule", [(2, 1, "1f1b"), (2, 3, "gpipe"), (4, 8, "1f1b"), (4, 4, "gpipe")])
def test_compiled_plans_verify(p, m, schedule):
    verify_plans(plans(p, m, schedule))


def _index(plan, pred):
    return next(i for i, ins in enumerate(plan.instructions) if pred(ins))


def test_dropped_recv_is_caught():
    ps = copy.deepcopy(plans())
    i = _index(ps[1], lambda ins: isinstance(ins, Recv))
    del ps[1].instructions[i]
    with pytest.raises(PlanError, match=r"rank 0, instruction #\d+ .*no matching recv on rank 1"):
        verify_plans(ps)


def test_swapped_recvs_are_caught():
    ps = copy.deepcopy(plans())
    recvs = [i for i, ins in enumerate(ps[1].instructions) if isinstance(ins, Recv)]
    a, b = recvs[0], recvs[1]
    ps[1].instructions[a], ps[1].instructions[b] = ps[1].instructions[b], ps[1].instructions[a]
    with pytest.raises(PlanError, match=r"rank 1, instruction #\d+.*out of order") as e:
        verify_plans(ps)
    assert "<-- ERROR HERE" in str(e.value)


def test_shape_mismatch_is_caught():
    ps = copy.deepcopy(plans())
    i = _index(ps[1], lambda ins: isinstance(ins, Recv))
    r = ps[1].instructions[i]
    bad = tuple(TensorSpec(t.name, (t.shape[0] + 1,) + t.shape[1:], t.dtype) for t in r.tensors)
    ps[1].instructions[i] = Recv(r.stage, r.microbatch, r.peer, r.direction, r.peer_stage, bad)
    with pytest.raises(PlanError, match=r"rank 1, instruction #\d+.*payload mismatch with rank 0"):
        verify_plans(ps)


def test_deadlock_is_caught():
    """Rank 1 waits for a gradient before it runs the forward that produces it."""
    ps = copy.deepcopy(plans(p=2, m=1))
    ins = ps[0].instructions
    recv_grad = _index(ps[0], lambda x: isinstance(x, Recv))
    moved = ins.pop(recv_grad)
    ins.insert(0, moved)
    with pytest.raises(PlanError, match="deadlock"):
        verify_plans(ps)
