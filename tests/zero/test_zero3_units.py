"""ZeRO stage 3 gathered per unit (enable_zero(stage=3, unit_bytes=...); See NOTE: ZeRO units in
graphc/runtime/zero_units.py) equals eager PyTorch on the whole batch in float64 at 1e-10
(helpers.py): in the one-process local world, data 2 with reshard-after-forward on and off,
gathered per micro-batch and once per step, accumulation 1 and 2, clipping, activation
checkpointing, a weight tied within the stage, pipeline 2 x data 2, and two chunks a rank
(interleaved 1F1B on pipeline 2 x data 2: each chunk gathered per unit); on real gloo ranks,
data 2. The plan lists each unit's gathers and releases inside its computes and prints, parses
and verifies; a per-unit plan holds fewer whole parameter bytes at once than the whole stage's.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
import graphc.testing
from graphc.plan.instructions import (GRAD, AllGather, Backward, Forward, ReduceScatter, ReleaseParams,
                                      UnitGather, UnitRelease, parse_instruction)
from graphc.plan.plan import ExecutionPlan
from helpers import assert_same_as_eager, run_world
from models import OPTIMIZERS
from test_zero_numerics import MIN_SIZE, Net, ZeroGraph, batches, eager, rows

UNIT_BYTES = 1   # every module its own unit: fc1, fc2, head


class UnitGraph(ZeroGraph):
    def __init__(self, model, opt, accumulation=1, clip=False, reshard=True, per="microbatch",
                 checkpointing="never"):
        super().__init__(model, opt, 3, accumulation, clip)
        self.config.enable_zero(True, stage=3, shard_min_size=MIN_SIZE, unit_bytes=UNIT_BYTES,
                                reshard_after_forward=reshard, gather_per=per)
        if checkpointing != "never":
            self.config.set_activation_checkpointing(checkpointing)


def _local_data_2(**options):
    where = graphc.placement("cpu", [0, 1])
    data = batches()

    def make():
        torch.manual_seed(0)
        model = graphc.to_global(Net(), placement=where, sbp=graphc.sbp.broadcast)
        return UnitGraph(model, OPTIMIZERS["adam"](model.parameters()), **options)

    def inputs(rank, step):
        x, y = data[step]
        return (graphc.to_global(rows(x, rank, 2), placement=where, sbp=graphc.sbp.split(0)),
                graphc.to_global(rows(y, rank, 2), placement=where, sbp=graphc.sbp.split(0)))

    return graphc.testing.local_world(make, inputs, 2, steps=len(data))


def _runtime(graph):
    return graph._cache.current.runtime


@pytest.mark.parametrize("accumulation,reshard,per,clip", [
    (1, True, "microbatch", False), (2, True, "microbatch", True),
    # CI time: reshard off and once per step both run in (2, False, "step", True)
    pytest.param(2, False, "microbatch", False, marks=pytest.mark.slow),
    pytest.param(2, True, "step", False, marks=pytest.mark.slow), (2, False, "step", True)])
def test_units_in_a_local_world_equal_eager(accumulation, reshard, per, clip):
    run = _local_data_2(accumulation=accumulation, clip=clip, reshard=reshard, per=per)
    ref_losses, ref_state = eager("adam", clip)
    what = f"units, accumulation {accumulation}, reshard {reshard}, per {per}, clip {clip}"
    assert_same_as_eager(run.losses, run.state, ref_losses, ref_state, what)
    plan = run.graphs[0].plan
    assert not any(type(i) in (AllGather, ReleaseParams) for i in plan.instructions)
    assert [i.unit for i in plan.instructions if isinstance(i, UnitGather)][:3] == [0, 1, 2]
    assert f"reshard after forward {'on' if reshard else 'off'}" in plan.notes["zero"]


def test_units_with_activation_checkpointing_equal_eager():
    """A checkpointed micro-batch's backward runs its forward again unit by unit, freeing each
    after its last use there but the last (the backward's first), and gathers fc2 again for the
    backward (fc1 no backward kernel reads): the whole stage is never whole at once."""
    run = _local_data_2(accumulation=2, checkpointing="always")
    ref_losses, ref_state = eager("adam", False)
    assert_same_as_eager(run.losses, run.state, ref_losses, ref_state, "units, checkpointing")
    plan = run.graphs[0].plan
    backward = [f"{type(i).__name__[4]}{i.unit}" for i in plan.instructions
                if isinstance(i, (UnitGather, UnitRelease)) and i.direction == GRAD and i.microbatch == 0]
    assert backward == ["G0", "R0", "G1", "R1", "G2", "R2", "G1", "R1"]
    zero = _runtime(run.graphs[0]).zero
    stage_bytes = sum(s.param.numel() * s.param.element_size() for s in zero.by_name.values())
    assert 0 < zero.max_whole_bytes < stage_bytes


def test_unit_plan_lists_each_compute_s_gathers_and_releases():
    """Reshard on, per micro-batch, accumulation 2: each forward gathers fc1, fc2, head in turn
    and frees each after it; each backward gathers head and fc2 in reverse (fc1 is linear in
    its weight on an input without gradient: no backward kernel reads it) and frees them; one
    REDUCE_SCATTER per unit in backward order. The listing parses back and JSON round-trips."""
    plan = _local_data_2(accumulation=2).graphs[0].plan
    text = str(plan)
    assert "0F0.GATHER u0 ranks=[0, 1] [model.fc1.weight:f64[33,16]]" in text
    per_compute, current = {}, None
    for ins in plan.instructions:
        if isinstance(ins, (Forward, Backward)):
            current = per_compute.setdefault(str(ins), [])
        elif isinstance(ins, (UnitGather, UnitRelease)):
            current.append(f"{type(ins).__name__[4]}{ins.unit}")
    assert per_compute["0F0"] == per_compute["0F1"] == ["G0", "R0", "G1", "R1", "G2", "R2"]
    assert per_compute["0B0"] == per_compute["0B1"] == ["G2", "R2", "G1", "R1"]
    scatters = [[t.name for t in i.tensors] for i in plan.instructions if isinstance(i, ReduceScatter)]
    assert scatters == [["model.head.weight"], ["model.fc2.weight"], ["model.fc1.weight"]]
    for ins in plan.instructions:
        assert parse_instruction(str(ins)) == ins
    assert ExecutionPlan.from_json(plan.to_json()).instructions == plan.instructions


def test_per_unit_plan_holds_fewer_whole_parameter_bytes():
    """The runtime's count of whole (gathered, not yet freed) parameter bytes at its highest:
    per unit (reshard on) at most the two largest units (one computing, the next prefetched),
    the whole stage's plan all three weights at once."""
    units = _local_data_2(accumulation=2)
    whole = _local_data_2_whole_stage()
    sizes = sorted((33 * 16, 24 * 33, 3 * 24), reverse=True)
    units_peak = _runtime(units.graphs[0]).zero.max_whole_bytes
    whole_peak = _runtime(whole.graphs[0]).zero.max_whole_bytes
    assert whole_peak == sum(sizes) * 8
    assert 0 < units_peak <= (sizes[0] + sizes[1]) * 8 < whole_peak


def _local_data_2_whole_stage():
    where = graphc.placement("cpu", [0, 1])
    data = batches()

    def make():
        torch.manual_seed(0)
        model = graphc.to_global(Net(), placement=where, sbp=graphc.sbp.broadcast)
        return ZeroGraph(model, OPTIMIZERS["adam"](model.parameters()), 3, 2, False)

    def inputs(rank, step):
        x, y = data[step]
        return (graphc.to_global(rows(x, rank, 2), placement=where, sbp=graphc.sbp.split(0)),
                graphc.to_global(rows(y, rank, 2), placement=where, sbp=graphc.sbp.split(0)))

    run = graphc.testing.local_world(make, inputs, 2, steps=len(data))
    assert any(type(i) is AllGather for i in run.graphs[0].plan.instructions)
    return run


class PipeUnitGraph(UnitGraph):
    """fc1 and norm on stage 0 (ranks 0, 1), fc2 and head on stage 1 (ranks 2, 3), each data 2."""

    def __init__(self, model, opt, accumulation, reshard):
        super().__init__(model, opt, accumulation, reshard=reshard)
        first, second = graphc.placement("cpu", [0, 1]), graphc.placement("cpu", [2, 3])
        self.model.fc1.config.set_stage(0, first)
        self.model.norm.config.set_stage(0, first)
        self.model.fc2.config.set_stage(1, second)
        self.model.head.config.set_stage(1, second)


@pytest.mark.parametrize("reshard", [True, False])
def test_units_on_pipeline_2_x_data_2_in_a_local_world_equal_eager(reshard):
    data = batches()

    def make():
        torch.manual_seed(0)
        model = Net()
        return PipeUnitGraph(model, OPTIMIZERS["adam"](model.parameters()), 2, reshard)

    def inputs(rank, step):
        x, y = data[step]
        return (graphc.to_global(rows(x, rank % 2, 2), placement=graphc.placement("cpu", [0, 1]),
                                 sbp=graphc.sbp.split(0)),
                graphc.to_global(rows(y, rank % 2, 2), placement=graphc.placement("cpu", [2, 3]),
                                 sbp=graphc.sbp.split(0)))

    run = graphc.testing.local_world(make, inputs, 4, steps=len(data))
    ref_losses, ref_state = eager("adam", False)
    assert_same_as_eager(run.losses, run.state, ref_losses, ref_state, f"units pp2 x dp2 reshard {reshard}")
    for graph in run.graphs:
        assert any(isinstance(i, UnitGather) for i in graph.plan.instructions)


class TiedNet(nn.Module):
    """fc2's weight is fc1's (a square 24 x 24), read twice in one stage."""

    def __init__(self):
        super().__init__()
        self.fc0, self.fc1, self.fc2 = nn.Linear(16, 24), nn.Linear(24, 24), nn.Linear(24, 24)
        self.fc2.weight = self.fc1.weight
        self.head = nn.Linear(24, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(torch.tanh(self.fc0(x)))))))


def test_units_with_a_weight_tied_in_the_stage_equal_eager():
    where = graphc.placement("cpu", [0, 1])
    data = batches()

    def make():
        torch.manual_seed(0)
        model = graphc.to_global(TiedNet(), placement=where, sbp=graphc.sbp.broadcast)
        return UnitGraph(model, OPTIMIZERS["adam"](model.parameters()), 2)

    def inputs(rank, step):
        x, y = data[step]
        return (graphc.to_global(rows(x, rank, 2), placement=where, sbp=graphc.sbp.split(0)),
                graphc.to_global(rows(y, rank, 2), placement=where, sbp=graphc.sbp.split(0)))

    run = graphc.testing.local_world(make, inputs, 2, steps=len(data))
    torch.manual_seed(0)
    model = TiedNet()
    opt = OPTIMIZERS["adam"](model.parameters())
    ref_losses = []
    for x, y in data:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    ref_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert_same_as_eager(run.losses, run.state, ref_losses, ref_state, "units, tied weight")
    # the tied weight is one unit, whole from fc1's read to fc2's
    gathered = [[t.name for t in i.tensors] for i in run.graphs[0].plan.instructions
                if isinstance(i, UnitGather) and i.direction == "F" and i.microbatch == 0]
    assert gathered == [["model.fc0.weight"], ["model.fc2.weight"], ["model.head.weight"]]


def _gloo_data_2(rank, world, configs):
    where = graphc.placement("cpu", [0, 1])
    out = {}
    for accumulation, reshard in configs:
        torch.manual_seed(0)
        model = graphc.to_global(Net(), placement=where, sbp=graphc.sbp.broadcast)
        graph = UnitGraph(model, OPTIMIZERS["adam"](model.parameters()), accumulation, reshard=reshard)
        losses = []
        for x, y in batches():
            xs = graphc.to_global(rows(x, rank, world), placement=where, sbp=graphc.sbp.split(0))
            ys = graphc.to_global(rows(y, rank, world), placement=where, sbp=graphc.sbp.split(0))
            losses.append(graph(xs, ys).to_local().item())
        out[(accumulation, reshard)] = {"losses": losses, "state": graph.full_state_dict(),
                                        "units": sum(isinstance(i, UnitGather) for i in graph.plan.instructions)}
    return out


GLOO = [(1, True), (2, False)]


@pytest.mark.world
def test_units_on_gloo_data_2_equal_eager():
    results = run_world(_gloo_data_2, 2, GLOO)
    ref_losses, ref_state = eager("adam", False)
    for rank, res in enumerate(results):
        for cfg in GLOO:
            assert res[cfg]["units"] > 0
            assert_same_as_eager(res[cfg]["losses"], res[cfg]["state"], ref_losses, ref_state,
                                 f"gloo units {cfg} rank {rank}")


def test_unit_gathers_are_counted_and_simulated():
    """A unit plan's gathers count in its bytes per step (each a quarter of the whole stage's
    here: reshard on, 2 micro-batches, fc1 not regathered for the backward: 2 x 3 + 2 x 2 unit
    gathers) and the simulator runs it."""
    from graphc.plan.traffic import step_bytes
    from graphc.tools.cost_model import CostModel
    from graphc.tools.simulate import simulate
    run = _local_data_2(accumulation=2)
    units, whole = run.graphs[0], _local_data_2_whole_stage().graphs[0]
    gathered = step_bytes(units.plan)["GATHER"]
    weights = {t.name: t for i in whole.plan.instructions if type(i) is AllGather for t in i.tensors}
    per_unit = {n: AllGather((0, 1), (t,)).padded_nbytes // 2 for n, t in weights.items()}
    assert gathered == 2 * sum(per_unit.values()) + 2 * (sum(per_unit.values()) - per_unit["model.fc1.weight"])
    assert step_bytes(whole.plan)["ALL_GATHER"] == sum(per_unit.values())
    assert simulate([g.plan for g in run.graphs], CostModel.uniform(1)).step_time > 0


def test_enable_zero_refuses_units_below_stage_3_and_bad_options():
    graph = graphc.Graph.__new__(UnitGraph)
    graphc.Graph.__init__(graph)
    with pytest.raises(graphc.GraphcError, match="unit_bytes gathers stage 3"):
        graph.config.enable_zero(True, stage=2, unit_bytes=2**20)
    with pytest.raises(graphc.GraphcError, match="gather_per must be one of"):
        graph.config.enable_zero(True, stage=3, unit_bytes=2**20, gather_per="layer")
    graph.config.enable_zero(True, stage=3, unit_bytes=2**20, reshard_after_forward={0: False, 1: True})
    assert graph.config.zero_reshard_after_forward == ((0, False), (1, True))


class InterleavedUnitGraph(UnitGraph):
    """Two chunks a rank (interleaved 1F1B): fc1 (stage 0) and fc2 (stage 2) on ranks 0, 1, norm
    (stage 1) and head (stage 3) on ranks 2, 3, each data 2."""

    def __init__(self, model, opt, reshard):
        super().__init__(model, opt, 2, reshard=reshard)
        first, second = graphc.placement("cpu", [0, 1]), graphc.placement("cpu", [2, 3])
        for s, (module, where) in enumerate([(self.model.fc1, first), (self.model.norm, second),
                                             (self.model.fc2, first), (self.model.head, second)]):
            module.config.set_stage(s, where)
        self.config.set_pipeline_schedule("interleaved_1f1b")


@pytest.mark.parametrize("reshard", [True, pytest.param(False, marks=pytest.mark.slow)])  # CI time
def test_units_on_ranks_with_two_chunks_in_a_local_world_equal_eager(reshard):
    data = batches()

    def make():
        torch.manual_seed(0)
        model = Net()
        return InterleavedUnitGraph(model, OPTIMIZERS["adam"](model.parameters()), reshard)

    def inputs(rank, step):
        x, y = data[step]
        return (graphc.to_global(rows(x, rank % 2, 2), placement=graphc.placement("cpu", [0, 1]),
                                 sbp=graphc.sbp.split(0)),
                graphc.to_global(rows(y, rank % 2, 2), placement=graphc.placement("cpu", [2, 3]),
                                 sbp=graphc.sbp.split(0)))

    run = graphc.testing.local_world(make, inputs, 4, steps=len(data))
    ref_losses, ref_state = eager("adam", False)
    assert_same_as_eager(run.losses, run.state, ref_losses, ref_state, f"units, two chunks a rank, reshard {reshard}")
    for graph in run.graphs:      # every chunk with sharded parameters gathers per unit
        plan = graph.plan
        assert not any(type(i) in (AllGather, ReleaseParams) for i in plan.instructions), str(plan)
        unit_stages = {i.stage for i in plan.instructions if isinstance(i, UnitGather)}
        assert unit_stages == ({0, 2} if plan.rank < 2 else {3}), (plan.rank, unit_stages)


def _gloo_two_chunks(rank, world):
    torch.manual_seed(0)
    model = Net()
    graph = InterleavedUnitGraph(model, OPTIMIZERS["adam"](model.parameters()), True)
    losses = []
    for x, y in batches():
        xs = graphc.to_global(rows(x, rank % 2, 2), placement=graphc.placement("cpu", [0, 1]), sbp=graphc.sbp.split(0))
        ys = graphc.to_global(rows(y, rank % 2, 2), placement=graphc.placement("cpu", [2, 3]), sbp=graphc.sbp.split(0))
        loss = graph(xs, ys).to_local()
        losses.append(loss.item() if loss.numel() else None)
    return {"losses": losses, "state": graph.full_state_dict(),
            "units": {i.stage for i in graph.plan.instructions if isinstance(i, UnitGather)}}


@pytest.mark.world
@pytest.mark.slow   # CI time: the local world above runs the same plans by default
def test_units_on_ranks_with_two_chunks_on_gloo_equal_eager():
    ref_losses, ref_state = eager("adam", False)
    for rank, res in enumerate(run_world(_gloo_two_chunks, 4)):
        assert res["units"] == ({0, 2} if rank < 2 else {3})
        losses = [v for v in res["losses"] if v is not None]
        assert len(losses) == (len(ref_losses) if rank >= 2 else 0)   # the loss: on the last stage
        assert_same_as_eager(losses or ref_losses, res["state"], ref_losses, ref_state,
                             f"gloo units, two chunks a rank, rank {rank}")
