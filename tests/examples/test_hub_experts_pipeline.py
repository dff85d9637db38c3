"""The router's auxiliary loss exact under accumulation through pipeline stages (issue 34;
See NOTE: Whole-batch sums, graphc/passes/feed_whole_sums.py): HF Mixtral and Qwen3-MoE
concatenate every layer's router logits at the last stage, whose token counts then need the
earlier stages' forward of every micro-batch before the step. The plan's pre-pass (PrePass
`0P0`, its values sent on as `0SEND_P0`) computes them; trained in the one-process local
world against eager PyTorch on the whole batch in float64, the aux loss in float64 too
(aux_in_float64: transformers sums it in float32), at 1e-10. Fixtures and layouts:
tests/examples/test_hub_experts.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphc.plan.instructions import PRE, Collective, PrePass, Recv, Send, parse_instruction
from graphc.plan.verify import verify_plans
from helpers import assert_close, run_world
from test_hub_experts import (LOSS_RTOL, MoEGraph, aux_in_float64, batches, check, eager, local_inputs,
                              model_of)

pytest.importorskip("transformers")


def pre_pass_of(plan) -> list:
    """The plan's pre-pass: its PrePass instructions, their transfers and collectives."""
    return [i for i in plan.instructions if isinstance(i, PrePass) or getattr(i, "direction", "") == PRE]


def test_mixtral_aux_loss_on_pp2xep2_at_accumulation_2():
    """Two stages of two expert-parallel ranks, the aux loss at the last: equal to eager
    (1e-10). Stage 0's ranks run their pre-pass (layer 0's experts exchanging, as in the
    forward) and send stage 1 the hidden states its routers read; stage 1's receive them
    first. The plans print and parse back, and the verifier refuses a pre-pass send left
    without its receive. One step (two: -m slow)."""
    graphs = check("mixtral", "pp2xep2", accumulation=2, aux64=True, steps=1)
    plans = [g.plan for g in graphs]   # each rank compiles its own
    first, last = pre_pass_of(plans[0]), pre_pass_of(plans[2])
    assert [str(i) for i in first if isinstance(i, PrePass)] == ["0P0", "0P1"]
    assert any(isinstance(i, Collective) and i.direction == PRE and "experts: tokens" in i.note for i in first)
    sends = [i for i in first if isinstance(i, Send)]
    assert [(s.direction, s.peer, s.microbatch) for s in sends] == [(PRE, 2, 0), (PRE, 2, 1)]
    assert "add_5" in {t.name for t in sends[0].tensors}   # layer 0's output: layer 1's router input
    assert [type(i).__name__ for i in last] == ["Recv", "PrePass", "Recv", "PrePass"]
    for plan in plans:
        assert [parse_instruction(str(i)) for i in plan.instructions] == plan.instructions
    verify_plans(plans, 4)
    del plans[2].instructions[plans[2].instructions.index(next(i for i in last if isinstance(i, Recv)))]
    with pytest.raises(Exception, match=r"SEND_P0"):
        verify_plans(plans, 4)


# -- the wider matrix (-m slow): Qwen3-MoE, accumulation 1 and 2, data x expert grids, the
# skewed router, the interleaved and V schedules (dualpipev: 4 micro-batches), ZeRO on the
# non-expert parameters ------------------------------------------------------------------------

CASES = [("qwen3_moe", "pp2xep2", 1, {}), ("qwen3_moe", "pp2xep2", 2, {}), ("mixtral", "pp2xep2", 2, {}),
         ("qwen3_moe", "pp2xdp2xep2", 2, {}), ("mixtral", "pp2xep2", 2, {"skewed": True}),
         ("qwen3_moe", "pp2xep2", 2, {"skewed": True}),
         ("mixtral", "pp2xep2_interleaved", 2, {}), ("qwen3_moe", "pp2xep2_interleaved", 2, {}),
         ("mixtral", "pp2xep2_zbv", 2, {}), ("mixtral", "pp2xep2_dualpipev", 4, {}),
         ("mixtral", "pp2xep2", 2, {"zero": 3}), ("qwen3_moe", "pp2xdp2xep2", 2, {"zero": 2})]


@pytest.mark.slow
@pytest.mark.parametrize("kind,layout,accumulation,options", CASES,
                         ids=[f"{k}-{l}-acc{a}" + "".join(f"-{o}{v}" for o, v in opt.items())
                              for k, l, a, opt in CASES])
def test_router_aux_loss_through_the_pipeline(kind, layout, accumulation, options):
    """Equal to eager at 1e-10 over two steps; with accumulation the last stage reads the
    whole batch's counts from the pre-pass (ZeRO stage 3: the stage's parameters gathered
    before it, See NOTE: Whole-batch sums)."""
    graphs = check(kind, layout, accumulation, aux64=True, **options)
    pre = [i for g in graphs for i in pre_pass_of(g.plan) if isinstance(i, PrePass)]
    assert bool(pre) == (accumulation > 1)


def _gloo_worker(rank, world):
    with aux_in_float64():
        graph = MoEGraph(model_of("mixtral"), "pp2xep2", accumulation=2)
        losses = [graph(*local_inputs("pp2xep2", rank, *d)).to_local() for d in batches()]
        return [float(x) if x.numel() else None for x in losses], graph.full_state_dict()


@pytest.mark.slow
@pytest.mark.world
def test_mixtral_aux_loss_on_pp2xep2_on_gloo():
    """Real processes on gloo: the pre-pass's SEND_P/RECV_P and its expert exchanges between
    processes, equal to eager at 1e-10 over two steps."""
    import torch
    with aux_in_float64():
        want_losses, want_state, _ = eager("mixtral", batches())
    results = run_world(_gloo_worker, 4)
    for losses, state in results:
        if losses[0] is not None:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=LOSS_RTOL, atol=0)
        for k, v in want_state.items():
            assert_close(state[k], v, f"gloo pp2 x ep2: {k}")
    assert any(losses[0] is not None for losses, _ in results)


@pytest.mark.slow
def test_graphc_check_of_mixtral_on_pp2_dp2_ep2_with_the_aux_loss():
    """`graphc check` of examples/moe.py on 8 ranks (2 stages, each data 2 x expert 2) with
    the router's aux loss at accumulation 2 exits 0 at its default bound (1e-10). The aux loss's
    sums in float64 (--aux-float64): transformers sums them in float32, which on micro-batches
    rounds otherwise than on the whole batch (measured without it: parameters 1.9e-10 apart at
    coefficient 0.01, 2.2e-10 at 0.001; with it 1.4e-17)."""
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "graphc", "check", "examples/moe.py", "--nproc", "8", "--steps", "2",
           "--", "--pp", "2", "--dp", "2", "--ep", "2", "--aux-loss", "0.01", "--aux-float64"]
    ok = subprocess.run(cmd, cwd=root, env=dict(os.environ, PYTHONPATH=str(root)), capture_output=True,
                        text=True, timeout=600)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "OK: 2 step(s)" in ok.stdout and "graphc check: OK" in ok.stdout
