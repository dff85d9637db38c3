"""cast_to_traced_dtypes: a row-parallel nn.Linear's bias, added after the partial product
(decompose_modules), is added in autocast's dtype as eager's F.linear adds it, so what its
all-reduce moves is what the plan lists: bf16, half of float32's bytes."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
import graphc.testing
from graphc import compiler, sbp
from graphc.plan.instructions import Collective
from graphc.runtime.local_world import LocalRank

pytestmark = pytest.mark.fp32


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.col, self.row = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.row(F.gelu(self.col(x))) * torch.tensor(0.5)   # a 0-dim float32 factor


class TensorParallel(graphc.Graph):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        p = graphc.placement("cpu", [0, 1])
        self.model = graphc.to_global(Pair(), placement=p, sbp=sbp.broadcast)
        graphc.to_global(self.model.col, placement=p, sbp=sbp.split(0))
        graphc.to_global(self.model.row.weight, placement=p, sbp=sbp.split(1))
        self.config.enable_amp(True, dtype=torch.bfloat16)

    def build(self, x, t):
        loss = F.cross_entropy(self.model(x), t)
        loss.backward()
        return loss


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=g), torch.randint(0, 8, (8,), generator=g)


def test_the_bias_is_added_in_the_compute_dtype():
    compiled = compiler.compile(TensorParallel(), list(_inputs()), 2)
    code = compiled.programs[0].module.code
    assert ".to(torch.bfloat16)" in code
    assert code.count(".to(") == 1          # the 0-dim factor promotes like a scalar: left alone
    assert {c.dtype for c in compiled.plans[0].instructions if isinstance(c, Collective)} == {"bfloat16"}


def test_the_all_reduce_moves_the_dtype_its_plan_lists(monkeypatch):
    moved = []
    reduce = LocalRank.all_reduce

    def spy(self, t, *args, **kwargs):
        moved.append(t.dtype)
        return reduce(self, t, *args, **kwargs)

    monkeypatch.setattr(LocalRank, "all_reduce", spy)
    graphc.testing.local_world(TensorParallel, [_inputs()], nproc=2)
    assert moved and set(moved) == {torch.bfloat16}
