"""Boxing on real gloo processes: every pair of {split(0), split(1), broadcast, partial_sum}.

For each pair (src, dst), on one placement and across two placements (a pipeline
boundary), a parameter W is converted to src, then to dst, and a loss (V * C).sum() is
taken on dst. Checked in float64 with tolerance 1e-10 (ATOL/RTOL of helpers.py):
  - each output's local component equals the matching shard of the full W (a partial_sum
    output is reduced before it is returned, so it equals W);
  - the loss equals eager's, and after one SGD step (lr=1) W == W0 - C and C == C0 - W0,
    i.e. the gradients flowing back through both conversions equal eager's.
The 5 x 3 shape splits unevenly (NOTE: Uneven splits): every collective moves shards of
unequal size, and across placements each rank sends and receives its own shard's shape.
"""
import itertools

import pytest
import torch
import torch.nn as nn

import graphc
from graphc import sbp
from graphc.sbp.layout import local_component
from helpers import ATOL, RTOL, run_world

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

LAYOUTS = {"S0": sbp.split(0), "S1": sbp.split(1), "B": sbp.broadcast, "P": sbp.partial_sum}
SHAPE, UNEVEN = (8, 8), (5, 3)  # 5 x 3 over 2 ranks: 3 + 2 rows, 2 + 1 columns


class Source(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(w.clone())


class Sink(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = nn.Parameter(c.clone())

    def forward(self, v):
        return (v * self.c).sum()


class Model(nn.Module):
    def __init__(self, w, c):
        super().__init__()
        self.source, self.sink = Source(w), Sink(c)


class BoxingGraph(graphc.Graph):
    def __init__(self, model, src, dst, p_src, p_dst):
        super().__init__()
        self.model = model
        self.src, self.dst, self.p_src, self.p_dst = src, dst, p_src, p_dst
        if p_src != p_dst:
            self.model.source.config.set_stage(0, p_src)
            self.model.sink.config.set_stage(1, p_dst)
            graphc.to_global(model.sink, placement=p_dst, sbp=sbp.broadcast)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=1.0))

    def build(self, x):
        v_src = graphc.to_global(self.model.source.w * x, placement=self.p_src, sbp=self.src)
        v_dst = graphc.to_global(v_src, placement=self.p_dst, sbp=self.dst)
        loss = self.model.sink(v_dst)
        loss.backward()
        return v_src, v_dst, loss


def _tensors(shape=SHAPE):
    g = torch.Generator().manual_seed(3)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _boxing_world(rank, world, shape):
    w, c = _tensors(shape)
    half = world // 2
    placements = {"same": (graphc.placement("cpu", list(range(world))),) * 2,
                  "cross": (graphc.placement("cpu", list(range(half))),
                            graphc.placement("cpu", list(range(half, world))))}
    out = {}
    for (where, (p_src, p_dst)), (a, b) in itertools.product(placements.items(),
                                                             itertools.product(LAYOUTS, LAYOUTS)):
        model = Model(w, c)
        graph = BoxingGraph(model, LAYOUTS[a], LAYOUTS[b], p_src, p_dst)
        v_src, v_dst, loss = graph(torch.ones(shape))
        out[(where, a, b)] = {"src": v_src.to_local(), "dst": v_dst.to_local(),
                              "shapes": {"src": tuple(v_src.shape), "dst": tuple(v_dst.shape)},
                              "loss": loss.to_local(), "state": graph.full_state_dict(),
                              "plan": str(graph.plan)}
    return out


@pytest.mark.parametrize("world,shape", [  # 4 ranks: -m slow (CI time)
    pytest.param(2, SHAPE, id="2-even"), pytest.param(2, UNEVEN, id="2-uneven", marks=pytest.mark.slow),   # CI time: uneven splits in test_uneven_splits
    pytest.param(4, SHAPE, id="4-even", marks=pytest.mark.slow),
    pytest.param(4, UNEVEN, id="4-uneven", marks=pytest.mark.slow)])
def test_every_sbp_pair_converts_values_and_gradients(world, shape):
    results = run_world(_boxing_world, world, shape)
    w, c = _tensors(shape)
    half = world // 2
    ref_loss = (w * c).sum()
    for rank, got in enumerate(results):
        for (where, a, b), r in got.items():
            what = f"world={world} {list(shape)} {where} {a}->{b} rank {rank}"
            p_src = list(range(world)) if where == "same" else list(range(half))
            p_dst = list(range(world)) if where == "same" else list(range(half, world))
            for key, layout, ranks in (("src", a, p_src), ("dst", b, p_dst)):
                if rank not in ranks:
                    assert r[key].numel() == 0, f"{what}: {key} on a rank outside its placement"
                    continue
                want = w if layout in ("B", "P") else \
                    local_component(w, (LAYOUTS[layout],), tuple(ranks), rank)
                torch.testing.assert_close(r[key], want, atol=ATOL, rtol=RTOL,
                                           msg=lambda m: f"{what}: {key} value\n{m}")
                assert r["shapes"][key] == shape, f"{what}: {key} global shape"
            if rank in p_dst:
                torch.testing.assert_close(r["loss"], ref_loss, atol=ATOL, rtol=RTOL)
            state = r["state"]
            torch.testing.assert_close(state["source.w"], w - c, atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"{what}: gradient of W\n{m}")
            torch.testing.assert_close(state["sink.c"], c - w, atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"{what}: gradient of C\n{m}")

