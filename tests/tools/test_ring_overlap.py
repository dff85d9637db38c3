"""The simulator's ring attention overlap (See NOTE: Ring overlap in graphc/tools/ring_overlap.py).

The causal block stack (tests/gpt_block_models.py, 1 layer) on a cp4 ring, compiled for 4
ranks in one process and simulated with hand-set costs: each forward ring step costs
max(0, t - b) after its compute, each backward step max(0, t(k, v) - 2b) + bytes(dk, dv) /
bandwidth, where the same plan without ring_blocks times every step's whole transfer in
turn; the step time falls by exactly the hidden seconds. device_costs fills ring_blocks from
the block's FLOPs: 4 q_numel Lk per block, causal (n+1)/(2n), an explicit mask as full.
"""
import os
import sys

import pytest
import torch

import graphc
from graphc import sbp
from graphc.plan.instructions import Collective
from graphc.tools.cost_model import CostModel
from graphc.tools.costs import device_costs
from graphc.tools.ring_overlap import ring_blocks
from graphc.tools.simulate import simulate
from helpers import compile_graph, global_input

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpt_block_models import BlockStack, TokenLossGraph  # noqa: E402

CP4 = graphc.placement("cpu", [0, 1, 2, 3])
B, T, H, E = 2, 16, 4, 4          # BlockStack: c=16, 4 heads of 4
BANDWIDTH, LATENCY, BLOCK = 1e6, 1e-4, 1e-3


def _cp4(kind: str = "sdpa"):
    torch.manual_seed(0)
    model = graphc.to_global(BlockStack(layers=1, block=T, kind=kind), placement=CP4, sbp=sbp.broadcast)
    graph = TokenLossGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    graph.config.set_context_parallel(method="ring")
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(B, T, 8, generator=g), torch.randint(0, 5, (B, T), generator=g)
    return compile_graph(graph, [global_input(x, CP4, sbp.split(1)), global_input(y, CP4, sbp.split(1))], 4)


@pytest.fixture(scope="module")
def cp4():
    return _cp4()


def _hidden(step: Collective) -> float:
    """Seconds of a ring step's transfer its block's compute hides (float32 and wider: the
    backward's k, v are half its bytes)."""
    if not step.note.startswith("ring step"):
        return 0.0
    if step.direction == "F":
        return min(LATENCY + step.nbytes / BANDWIDTH, BLOCK)
    return min(LATENCY + step.nbytes / 2 / BANDWIDTH, 2 * BLOCK)


def test_ring_steps_are_timed_beside_their_blocks(cp4):
    plan = cp4.plans[0]
    steps = [i for i in plan.instructions if isinstance(i, Collective) and i.kind == "send_recv"]
    assert len(steps) == 3 + 4
    nodes = {(i.stage, i.node) for i in steps}
    whole = CostModel({0: 0.01}, {0: 0.02}, bandwidth=BANDWIDTH, latency=LATENCY)
    beside = CostModel({0: 0.01}, {0: 0.02}, bandwidth=BANDWIDTH, latency=LATENCY,
                       ring_blocks={n: BLOCK for n in nodes})
    for i in steps:    # forward: 2 KiB of k, v (2.148 ms) beside a 1 ms block; backward 4 KiB
        if i.note.startswith("ring step") and i.direction == "F":
            assert beside.collective(i) == pytest.approx(LATENCY + i.nbytes / BANDWIDTH - BLOCK)
        elif i.note.startswith("ring step"):
            assert beside.collective(i) == pytest.approx(
                max(0.0, LATENCY + i.nbytes / 2 / BANDWIDTH - 2 * BLOCK) + i.nbytes / 2 / BANDWIDTH)
        else:   # the step home waits at once
            assert beside.collective(i) == whole.collective(i)
    before, after = simulate(cp4.plans, whole).step_time, simulate(cp4.plans, beside).step_time
    assert before - after == pytest.approx(sum(_hidden(i) for i in steps), rel=1e-9)
    assert after < before


def test_device_costs_fill_ring_blocks_from_flops(cp4):
    blocks = ring_blocks(cp4, 1.0, 1.0)     # 1 FLOP/s: seconds are FLOPs
    assert len(blocks) == 1
    per_block = 4 * (B * H * (T // 4) * E) * (T // 4)     # q.k and p.v of one rank's queries, one key block
    assert set(blocks.values()) == {per_block * 5 / 8}      # causal: (n+1)/(2n) on average
    costs = device_costs(cp4, "h100")
    assert set(costs.ring_blocks) == set(blocks)


def test_an_explicit_mask_is_counted_as_full():
    """A ring with an explicit mask (HF's causal-and-padding one) skips the blocks it hides by
    reading it; counting FLOPs on fake tensors it has no values, so every block is counted
    (it raised DataDependentOutputException from `graphc plan --simulate h100` on HF Llama)."""
    masked = _cp4("sdpa_mask")
    assert set(ring_blocks(masked, 1.0, 1.0).values()) == {4 * (B * H * (T // 4) * E) * (T // 4)}
    assert device_costs(masked, "h100").forward[0] > 0
