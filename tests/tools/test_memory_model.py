"""The predicted peak memory per rank (See NOTE: Peak memory model in
graphc/tools/simulate/peak.py) in one process: the walk's bytes by hand, its tables of kinds,
and the "will it fit" report. Prediction against measurement on running ranks:
tests/tools/test_memory_measured.py.
"""

import torch
import torch.nn as nn

import graphc
from graphc.compiler import compile as compile_graph
from graphc.tools.costs import device_costs
from graphc.tools.cost_model import CostModel
from graphc.tools.simulate import fit_report, memory_peak, model_inputs, simulate

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


def test_memory_effects_are_read_by_kind_not_by_an_isinstance_order():
    """The walk tells kinds apart by what each kind names: compute parts by their run entry (as
    the runtime dispatches), other kinds by their `holds`, a Walk method (a unit gather gathers
    as AllGather does, a clip's all-reduce frees gradients as a sum's does). Every registered
    kind's effect is the one this table gives it: those not listed hold nothing."""
    from graphc.plan import instructions as kinds
    from graphc.tools.simulate.memory_walk import COMPUTES, Walk
    effects = {kinds.Recv: "recv", kinds.Send: "send", kinds.ReduceScatter: "scatter",
               kinds.AllReduce: "reduce", kinds.TieAllReduce: "reduce",
               kinds.ClipGradNorm: "reduce", kinds.OptimizerStep: "optimizer_step",
               kinds.AllGather: "gather", kinds.UnitGather: "gather",
               kinds.ReleaseParams: "release", kinds.UnitRelease: "release"}
    assert {cls: cls.holds for cls in kinds.INSTRUCTIONS if cls.holds} == effects
    assert all(callable(getattr(Walk, name)) for name in effects.values())
    assert set(COMPUTES) == {cls.runs for cls in kinds.STAGE_COMPUTES}


def test_fit_report_says_which_rank_which_instruction_by_how_much_and_what_to_change():
    graph, compiled = _compiled("pp2")
    result = simulate(compiled.plans, device_costs(compiled, "h100"),
                      model=model_inputs(compiled, graph._optimizer))
    peaks = {r.rank: r.memory for r in result.ranks}
    worst = max(peaks.values(), key=lambda m: m.peak)
    assert "peak MiB" in result.table() and worst.at in result.table()
    fits = fit_report(peaks, 80 * 2 ** 30, "h100", compiled.plans)
    assert "fits" in fits and "NOT" not in fits
    capacity = worst.peak * 9 // 10
    tight = fit_report(peaks, capacity, "tiny", compiled.plans)
    head, *changes = tight.splitlines()
    assert f"highest rank {worst.rank}, peak {worst.peak / 2**20:.2f} MiB at {worst.at}" in head
    over = [r for r, m in sorted(peaks.items()) if m.peak > capacity]
    assert f"DOES NOT FIT on ranks {over}, {(worst.peak - capacity) / 2**20:.2f} MiB over " \
        f"({(worst.peak - capacity) / capacity:.0%} of the device)" in head
    # one rank a stage: ZeRO has nothing to shard over, a deeper pipeline halves the state
    assert any("this stage has none: give it several ranks" in c for c in changes)
    state = sum(worst.parts.get(k, 0) for k in ("parameters", "optimizer", "gradients", "gradient buffers"))
    assert f"  - more pipeline stages (twice as many) or tensor parallelism (2 ranks a layer) halve the " \
        f"parameters and their state on a rank: saves ~{state // 2 / 2**20:.2f} MiB at the peak (enough alone)" in changes
    assert "set_gradient_accumulation_steps(8)" in tight and "set_activation_checkpointing" in tight


def test_fit_report_on_data_parallel_names_the_next_zero_stage_and_its_saving():
    graph, compiled = _compiled("dp2")
    model = model_inputs(compiled, graph._optimizer)
    costs = CostModel({0: 1.0}, {0: 2.0}, activation_bytes={0: 10_000})
    peaks = {p.rank: memory_peak(p, model.params[p.rank], costs) for p in compiled.plans}
    tight = fit_report(peaks, peaks[0].peak // 2, "tiny", compiled.plans)
    optimizer = peaks[0].parts["optimizer"]
    assert f"config.enable_zero(True, stage=1) shards the optimizer over the 2 data-parallel ranks: " \
        f"saves ~{optimizer // 2 / 2**20:.2f} MiB at the peak" in tight
    assert tight.splitlines()[1].startswith("  - more pipeline stages")   # the largest saving first
