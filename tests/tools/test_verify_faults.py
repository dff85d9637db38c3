"""The plan verifier catches injected faults and names the rank in its message."""
import dataclasses

import pytest
import torch

from graphc import PlanError, compiler
from graphc.plan.instructions import AllReduce, Recv, TensorSpec
from graphc.plan.verify import verify_plans
from models import PipelineGraph, SkipNet


@pytest.fixture(scope="module")
def plans():
    graph = PipelineGraph(SkipNet(4), None, accumulation=4)
    return compiler.compile(graph, [torch.randn(16, 16), torch.randint(0, 5, (16,))], 4).plans


def _copy(plans):
    return [dataclasses.replace(p, instructions=list(p.instructions)) for p in plans]


def _recv_indices(plan):
    return [i for i, ins in enumerate(plan.instructions) if isinstance(ins, Recv)]


def test_compiled_plans_verify(plans):
    verify_plans(plans)


def test_dropped_recv(plans):
    bad = _copy(plans)
    del bad[2].instructions[_recv_indices(bad[2])[0]]
    with pytest.raises(PlanError, match="rank 2") as e:
        verify_plans(bad)
    assert "no matching recv" in str(e.value) and "<-- ERROR HERE" in str(e.value)


def test_two_recvs_swapped(plans):
    bad = _copy(plans)
    i, j = [k for k in _recv_indices(bad[1]) if bad[1].instructions[k].direction == "F"][:2]
    ins = bad[1].instructions
    ins[i], ins[j] = ins[j], ins[i]
    with pytest.raises(PlanError, match="rank 1") as e:
        verify_plans(bad)
    assert "out of order" in str(e.value)


def test_shape_mismatch(plans):
    bad = _copy(plans)
    k = _recv_indices(bad[3])[0]
    r = bad[3].instructions[k]
    wrong = tuple(TensorSpec(t.name, (t.shape[0] + 1,) + t.shape[1:], t.dtype) for t in r.tensors)
    bad[3].instructions[k] = dataclasses.replace(r, tensors=wrong)
    with pytest.raises(PlanError, match="rank 3") as e:
        verify_plans(bad)
    assert "payload mismatch" in str(e.value)


def test_all_reduce_missing_on_one_rank(plans):
    bad = _copy(plans)
    ar = AllReduce((0, 1, 2, 3), (TensorSpec("grad", (16, 16), "float32"),))
    for p in bad[:3]:               # rank 3 never issues it
        p.instructions.insert(len(p.instructions) - 1, ar)
    with pytest.raises(PlanError, match="missing on rank 3"):
        verify_plans(bad)
