"""The predicted peak memory per rank (See NOTE: Peak memory model in
graphc/tools/simulate/peak.py): in one process, the walk's bytes by hand and the "will it fit"
report; on real gloo ranks, the prediction against the peak the profiler's allocator events
measure (every tensor the rank's CPU allocator hands out, from before the model is made).

Tolerance of the measured comparison: the model counts what a rank holds at instruction
boundaries (and a backward's larger end), not an op's own temporaries inside a compute; on
this model (8 residual blocks 128 -> 512 -> 128, 256 rows, Adam) those are the gradient
flowing between two layers and a layer's pre-activation, <= 5.5% of the peak (on a narrower
model they weigh more: 8% at width 32). So the prediction is within [0.94, 1.02] of the measured peak for data
parallel, pipelines (1F1B, 4 micro-batches) and pipelines with checkpointing. Not claimed
here (measured in the note of issue 31): tensor parallel (the fake-tensor count of saved
activations misses the replicated inputs of a split layer: 0.80-0.83), pipelines x data
parallel (0.81: the accumulated gradients and the bucket both alive), and ZeRO (gloo frees a
collective's buffers on its own thread, where the profiler does not see the free, so the
measured peak differs between ranks of one stage).
"""
import os

import pytest
import torch
import torch.nn as nn

import graphc
from graphc.compiler import compile as compile_graph
from graphc.tools.costs import device_costs
from graphc.tools.cost_model import CostModel
from graphc.tools.simulate import fit_report, memory_peak, model_inputs, simulate
from helpers import run_world

W, H, LAYERS, BATCH = 32, 128, 4, 64


class Block(nn.Module):
    def __init__(self, w=W, h=H):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(w, h), nn.Linear(h, w)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Deep(nn.Module):
    def __init__(self, layers=LAYERS, w=W, h=H):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(w, h) for _ in range(layers)])

    def forward(self, x):
        return self.blocks(x)


class Squares(graphc.Graph):
    def __init__(self, model, layout, make_opt=lambda ps: torch.optim.Adam(ps, lr=1e-3)):
        super().__init__()
        self.model = model
        cpu, n = graphc.placement, len(self.model.blocks)
        if layout.startswith("pp2"):
            for i, b in enumerate(self.model.blocks):
                s = int(i >= n // 2)
                b.config.set_stage(s, cpu("cpu", [s]))
            self.config.set_gradient_accumulation_steps(4)
            if layout == "pp2ckpt":
                self.config.set_activation_checkpointing("always")
        else:
            self.model.config.set_stage(0, cpu("cpu", [0, 1]))
        self.add_optimizer(make_opt(self.model.parameters()))

    def build(self, x):
        loss = (self.model(x) ** 2).mean()
        loss.backward()
        return loss


def _inputs(layout):
    x = torch.randn(BATCH, W)
    if layout == "dp2":
        return [(graphc.placement("cpu", [0, 1]), (graphc.sbp.split(0),))], x
    return [(graphc.placement("cpu", [0]), (graphc.sbp.broadcast,))], x


def _compiled(layout, layers=LAYERS):
    torch.manual_seed(0)
    graph = Squares(Deep(layers), layout)
    where, x = _inputs(layout)
    return graph, compile_graph(graph, [x], 2, where)


def test_data_parallel_peak_is_model_state_and_gradients_after_the_backward():
    """dp2, Adam, one micro-batch: the peak ends the backward: parameters, Adam's 2 states,
    the gradient bucket kept between steps, and the whole gradients made by the backward
    (its activations freed); before it the forward held the activations instead."""
    graph, compiled = _compiled("dp2")
    params = model_inputs(compiled, graph._optimizer).params[0]
    p = sum(s.nbytes for s in params)
    act = 10_000
    peak = memory_peak(compiled.plans[0], params, CostModel({0: 1.0}, {0: 2.0}, activation_bytes={0: act}))
    assert peak.held == 4 * p                          # parameters, 2 states, the bucket
    assert peak.peak == 5 * p and peak.at.endswith("0B0")
    assert peak.parts == {"parameters": p, "optimizer": 2 * p, "gradient buffers": p, "gradients": p}


def test_pipeline_holds_the_schedules_micro_batches_in_flight():
    """1F1B on 2 stages, 4 micro-batches: stage 0 holds 2 micro-batches' activations before its
    first backward, stage 1 one; checkpointing keeps only each micro-batch's stage inputs until
    its backward recomputes them."""
    graph, compiled = _compiled("pp2")
    model = model_inputs(compiled, graph._optimizer)
    act, inputs = 1 << 20, 1 << 10
    costs = CostModel({0: 1.0, 1: 1.0}, {0: 2.0, 1: 2.0}, activation_bytes={0: act, 1: act},
                      input_bytes={0: inputs, 1: inputs})
    first, last = (memory_peak(p, model.params[p.rank], costs) for p in compiled.plans)
    assert first.parts["activations"] == 2 * act
    assert last.parts["activations"] == act
    graph, compiled = _compiled("pp2ckpt")
    first = memory_peak(compiled.plans[0], model.params[0], costs)
    assert first.parts["activations"] <= act + 2 * inputs   # one recomputed, the others' inputs


def test_memory_events_name_instruction_kinds_exactly():
    """The memory model tells kinds apart by class, not by an isinstance order: every key is
    an instruction class, and a subclass is listed with what it does (a unit gather gathers,
    a clip's all-reduce is a sum's, a reduce-scatter scatters)."""
    from graphc.plan.instructions import (INSTRUCTIONS, AllGather, ClipGradNorm, ReduceScatter,
                                          UnitGather, UnitRelease)
    from graphc.tools.simulate.peak import MEMORY_EVENTS
    assert set(MEMORY_EVENTS) <= set(INSTRUCTIONS)
    assert MEMORY_EVENTS[UnitGather] == MEMORY_EVENTS[AllGather] == "gather"
    assert MEMORY_EVENTS[ClipGradNorm] == "reduce" and MEMORY_EVENTS[ReduceScatter] == "scatter"
    assert MEMORY_EVENTS[UnitRelease] == "release"


def test_fit_report_says_what_to_change():
    graph, compiled = _compiled("pp2")
    result = simulate(compiled.plans, device_costs(compiled, "h100"),
                      model=model_inputs(compiled, graph._optimizer))
    peaks = {r.rank: r.memory for r in result.ranks}
    worst = max(peaks.values(), key=lambda m: m.peak)
    assert "peak MiB" in result.table() and worst.at in result.table()
    fits = fit_report(peaks, 80 * 2 ** 30, "h100", compiled.plans[0])
    assert "fits" in fits and "NOT" not in fits
    tight = fit_report(peaks, worst.peak - 1, "tiny", compiled.plans[0])
    assert f"DOES NOT FIT on ranks [{worst.rank}]" in tight
    # this small model's peak is mostly Adam's state and the gradients; its stages have one rank
    assert "enable_zero(True, stage=1) shards it over the data-parallel ranks (this stage has " \
        "none: give it several ranks)" in tight
    assert "more pipeline stages or tensor parallelism" in tight


# -- against real ranks ------------------------------------------------------------------------

def _measured_peak(rank, world, layout):
    """(predicted, measured) peak bytes of this rank's third step (the profiler's allocator
    events from before the model was made: every live tensor counted)."""
    import json
    import tempfile
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        graph = Squares(Deep(8, 128, 512), layout)     # 4 MiB of parameters
        x = torch.randn(256, 128)
        if layout == "dp2":
            x = graphc.to_global(x.chunk(2)[rank].clone(), placement=graphc.placement("cpu", [0, 1]),
                                 sbp=graphc.sbp.split(0))
        for step in range(3):
            with record_function(f"step{step}"):
                graph(x)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    window = next(e for e in events if e.get("name") == "step2")
    t0, t1 = window["ts"], window["ts"] + window["dur"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    inside = [e["args"]["Total Allocated"] for e in memory if t0 <= e["ts"] <= t1]
    plan = next(p for p in graph.compiled.plans if p.rank == rank)
    predicted = memory_peak(plan, model_inputs(graph.compiled, graph._optimizer).params[rank],
                            device_costs(graph.compiled, "h100"))
    return predicted.peak, max(inside)


@pytest.mark.world
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "pp2", "pp2ckpt"])
def test_predicted_peak_against_the_measured_one(layout):
    for rank, (predicted, measured) in enumerate(run_world(_measured_peak, 2, layout)):
        assert 0.94 * measured <= predicted <= 1.02 * measured, \
            f"{layout} rank {rank}: predicted {predicted / 2**20:.3f} MiB, measured {measured / 2**20:.3f} MiB"
