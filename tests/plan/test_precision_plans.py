"""Under enable_amp, what crosses ranks inside the step travels in the compute dtype, and the
plans say so: a pipeline's activation and gradient sends and tensor parallelism's boxing
collectives list bfloat16 and count half of float32's bytes (compiled for 2 ranks in one
process). The verifier refuses plans whose send and recv, or whose members of a collective,
disagree on a dtype."""
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import GraphcError, compiler, sbp
from graphc.plan.instructions import AllReduce, Collective, Recv, Send, TensorSpec, parse_instruction
from graphc.plan.verify import verify_plans

pytestmark = pytest.mark.fp32
M = 2


class Pipeline(nn.Module):
    def __init__(self):
        super().__init__()
        self.stage0 = nn.Sequential(nn.Linear(16, 32), nn.GELU())
        self.stage1 = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 5))

    def forward(self, x):
        return self.stage1(self.stage0(x))


class Megatron(nn.Module):
    """A replicated layer, then Megatron's pair (column-, then row-parallel) and a head:
    one all-reduce in the forward (after `row`) and one in the backward (before `col`)."""

    def __init__(self):
        super().__init__()
        self.pre, self.col, self.row, self.head = (nn.Linear(16, 16), nn.Linear(16, 32),
                                                   nn.Linear(32, 16), nn.Linear(16, 5))

    def forward(self, x):
        return self.head(self.row(F.gelu(self.col(self.pre(x)))))


class Step(graphc.Graph):
    def __init__(self, layout: str, amp: bool):
        super().__init__()
        if layout == "pipeline":
            self.model = Pipeline()
            self.model.stage0.config.set_stage(0, graphc.placement("cpu", [0]))
            self.model.stage1.config.set_stage(1, graphc.placement("cpu", [1]))
        else:  # tensor parallel; data parallel with split(0) inputs
            p01 = graphc.placement("cpu", [0, 1])
            self.model = graphc.to_global(Megatron(), placement=p01, sbp=sbp.broadcast)
            if layout == "tensor":
                graphc.to_global(self.model.col, placement=p01, sbp=sbp.split(0))
                graphc.to_global(self.model.row.weight, placement=p01, sbp=sbp.split(1))
        if amp:
            self.config.enable_amp(True, dtype=torch.bfloat16)
        self.config.set_gradient_accumulation_steps(M)
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _plans(layout: str, amp: bool):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
    return compiler.compile(Step(layout, amp), [x, y], 2).plans


@pytest.fixture(scope="module")
def plans():
    # module-scoped: made before the fp32 mark sets the default dtype, so it sets it itself
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        return {(layout, amp): _plans(layout, amp) for layout in ("pipeline", "tensor")
                for amp in (False, True)}
    finally:
        torch.set_default_dtype(old)


def _moved(plans, kinds):
    """(bytes, dtypes, directions) of every instruction of `kinds` over all ranks' plans."""
    found = [ins for p in plans for ins in p.instructions if isinstance(ins, kinds)]
    dtypes = {t.dtype for ins in found for t in ins.tensors} if kinds != Collective else \
        {ins.dtype for ins in found}
    return sum(ins.nbytes for ins in found), dtypes, {ins.direction for ins in found}


@pytest.mark.parametrize("layout, kinds", [("pipeline", (Send, Recv)), ("tensor", Collective)])
def test_amp_halves_what_crosses_ranks(plans, layout, kinds):
    wide, wide_dtypes, directions = _moved(plans[(layout, False)], kinds)
    narrow, narrow_dtypes, _ = _moved(plans[(layout, True)], kinds)
    assert wide_dtypes == {"float32"} and narrow_dtypes == {"bfloat16"}
    assert directions == {"F", "B"}          # activations and their gradients alike
    assert wide > 0 and narrow * 2 == wide


def test_the_plan_prints_a_collectives_dtype_and_reads_it_back(plans):
    text = str(plans[("tensor", True)][0])
    assert ".ALL_REDUCE " in text and ":bf16 partial_sum->broadcast" in text
    for ins in plans[("tensor", True)][0].instructions:
        assert parse_instruction(str(ins)) == ins
    old = "0F0.ALL_REDUCE box_1 partial_sum->broadcast ranks=[0, 1] bytes=512"  # plans before dtypes
    assert parse_instruction(old).dtype == "" and str(parse_instruction(old)) == old


class Residual(nn.Module):
    """Megatron's MLP block on a float32 residual stream: under autocast the row-parallel
    product is bf16 and the residual sum float32."""

    def __init__(self):
        super().__init__()
        self.norm, self.col, self.row, self.out = (nn.LayerNorm(16), nn.Linear(16, 32),
                                                   nn.Linear(32, 16), nn.LayerNorm(16))

    def forward(self, x):
        return self.out(x + self.row(F.gelu(self.col(self.norm(x)))))


class ResidualStep(graphc.Graph):
    def __init__(self, amp: bool):
        super().__init__()
        p01 = graphc.placement("cpu", [0, 1])
        self.model = graphc.to_global(Residual(), placement=p01, sbp=sbp.broadcast)
        graphc.to_global(self.model.col, placement=p01, sbp=sbp.split(0))
        graphc.to_global(self.model.row.weight, placement=p01, sbp=sbp.split(1))
        if amp:
            self.config.enable_amp(True, dtype=torch.bfloat16)

    def build(self, x):
        loss = self.model(x).square().mean()
        loss.backward()
        return loss


def test_the_partial_product_is_reduced_before_the_float32_residual_add():
    """The all-reduce goes where the partial sum is still bf16 (Megatron's), not after the
    residual add widened it to float32: half the bytes, one collective alike."""
    def forward_reduces(amp):
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            plan = compiler.compile(ResidualStep(amp), [torch.randn(8, 16)], 2).plans[0]
        finally:
            torch.set_default_dtype(old)
        return [c for c in plan.instructions if isinstance(c, Collective) and c.direction == "F"]
    wide, narrow = forward_reduces(False), forward_reduces(True)
    assert len(wide) == len(narrow) == 1 and narrow[0].dtype == "bfloat16"
    assert narrow[0].nbytes * 2 == wide[0].nbytes


def _copy(plans):
    return [dataclasses.replace(p, instructions=list(p.instructions)) for p in plans]


def _first(plan, cls):
    return next(i for i, ins in enumerate(plan.instructions) if isinstance(ins, cls))


def test_a_recv_expecting_another_dtype_fails(plans):
    bad = _copy(plans[("pipeline", True)])
    k = _first(bad[1], Recv)
    recv = bad[1].instructions[k]
    t = recv.tensors[0]
    bad[1].instructions[k] = dataclasses.replace(recv, tensors=(TensorSpec(t.name, t.shape, "float32"),))
    with pytest.raises(GraphcError, match=f"rank 1, instruction #{k}") as e:
        verify_plans(bad)
    assert "dtype mismatch with rank 0" in str(e.value) and ":bf16[" in str(e.value)


def test_a_collective_member_in_another_dtype_fails(plans):
    bad = _copy(plans[("tensor", True)])
    k = _first(bad[1], Collective)
    bad[1].instructions[k] = dataclasses.replace(bad[1].instructions[k], dtype="float32")
    with pytest.raises(GraphcError, match=f"rank 1, instruction #{k}") as e:
        verify_plans(bad)
    assert "dtype float32 on rank 1, bfloat16 on rank 0" in str(e.value)


def test_a_gradient_bucket_in_another_dtype_fails():
    p01 = graphc.placement("cpu", [0, 1])
    plans = compiler.compile(Step("data", True), [torch.randn(4, 16), torch.randint(0, 5, (4,))], 2,
                             [(p01, sbp.split(0))] * 2).plans
    bad = _copy(plans)
    k = _first(bad[1], AllReduce)
    bucket = bad[1].instructions[k]
    t = bucket.tensors[0]
    bad[1].instructions[k] = dataclasses.replace(
        bucket, tensors=(TensorSpec(t.name, t.shape, "bfloat16"),) + bucket.tensors[1:])
    with pytest.raises(GraphcError, match=f"rank 1, instruction #{k}") as e:
        verify_plans(bad)
    assert "(a dtype mismatch)" in str(e.value)
