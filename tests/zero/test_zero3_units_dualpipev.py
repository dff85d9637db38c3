"""ZeRO stage 3 per unit on DualPipeV: each overlapped pair `(0F3;3B1)OVERLAP_F_B` lists its
forward's unit gathers and releases, then its backward's (two chunks, in the order the pair runs
them), the step equals eager PyTorch on the whole batch in float64 at 1e-10 (helpers.py) in the
one-process local world on pipeline 2 x data 2, and the memory model's predicted peak per rank
drops below the whole-stage gathers'. See NOTE: ZeRO units in graphc/runtime/zero_units.py.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
import graphc.testing
from graphc.compiler import compile as compile_graph
from graphc.plan.instructions import AllGather, OverlapFB, ReleaseParams, UnitGather, UnitRelease
from graphc.plan.plan import ExecutionPlan
from graphc.tools.costs import device_costs
from graphc.tools.simulate import memory_peak, model_inputs
from helpers import assert_same_as_eager, run_world
from test_zero_numerics import MIN_SIZE, ZeroGraph, batches, rows

ACCUMULATION = 4        # DualPipeV pairs a chunk's forward with the other's backward from here


class Tower(nn.Module):
    """Two layers per chunk of a V: stage 0 (inp, l0) and 3 (l5, head) on ranks 0, 1, stages 1
    (l1, l2) and 2 (l3, l4) on ranks 2, 3; every weight sharded (MIN_SIZE), so each chunk has
    two units."""

    def __init__(self, width=24):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(6))
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


CHUNKS = [("inp", 0), (1, 2), (3, 4), (5, "head")]     # a layer's index, or a module's name


class DualPipeGraph(ZeroGraph):
    def __init__(self, model, unit_bytes, reshard=True, per="microbatch", checkpointing="never"):
        super().__init__(model, torch.optim.Adam(model.parameters(), lr=1e-2), 3, ACCUMULATION, False)
        self.config.enable_zero(True, stage=3, shard_min_size=MIN_SIZE, unit_bytes=unit_bytes,
                                reshard_after_forward=reshard, gather_per=per)
        if checkpointing != "never":
            self.config.set_activation_checkpointing(checkpointing)
        first, second = graphc.placement("cpu", [0, 1]), graphc.placement("cpu", [2, 3])
        for stage, (names, where) in enumerate(zip(CHUNKS, [first, second, second, first])):
            for name in names:
                module = self.model.layers[name] if isinstance(name, int) else getattr(self.model, name)
                module.config.set_stage(stage, where)
        self.config.set_pipeline_schedule("dualpipev")


def _eager():
    torch.manual_seed(0)
    model = Tower()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _pair_events(plan):
    """(the pair, the (stage, direction, micro-batch) of each unit event listed after it)."""
    for i, pair in enumerate(plan.instructions):
        if isinstance(pair, OverlapFB):
            after = []
            for ins in plan.instructions[i + 1:]:
                if not isinstance(ins, (UnitGather, UnitRelease)):
                    break
                after.append((ins.stage, ins.direction, ins.microbatch))
            yield pair, after


@pytest.mark.parametrize("reshard,per,checkpointing", [
    (True, "microbatch", "never"),
    pytest.param(False, "microbatch", "never", marks=pytest.mark.slow),     # CI time
    pytest.param(True, "step", "never", marks=pytest.mark.slow),
    pytest.param(True, "microbatch", "always", marks=pytest.mark.slow)])
def test_units_on_dualpipev_pairs_equal_eager(reshard, per, checkpointing):
    data, x_at = batches(), graphc.placement("cpu", [0, 1])

    def make():
        torch.manual_seed(0)
        return DualPipeGraph(Tower(), 1, reshard, per, checkpointing)

    def inputs(rank, step):
        x, y = data[step]
        return (graphc.to_global(rows(x, rank % 2, 2), placement=x_at, sbp=graphc.sbp.split(0)),
                graphc.to_global(rows(y, rank % 2, 2), placement=x_at, sbp=graphc.sbp.split(0)))

    run = graphc.testing.local_world(make, inputs, 4, steps=len(data))
    ref_losses, ref_state = _eager()
    assert_same_as_eager(run.losses, run.state, ref_losses, ref_state,
                         f"units, dualpipev, pp2 x dp2, reshard {reshard}, per {per}, {checkpointing}")
    both = 0
    for graph in run.graphs:
        plan = graph.plan
        assert not any(type(i) in (AllGather, ReleaseParams) for i in plan.instructions), str(plan)
        pairs = list(_pair_events(plan))
        assert pairs, str(plan)
        for pair, after in pairs:   # the forward's events, then the backward's
            forward = (pair.forward.stage, "F", pair.forward.microbatch)
            backward = (pair.backward.stage, "B", pair.backward.microbatch)
            assert set(after) <= {forward, backward}, (str(pair), after)
            assert after == sorted(after, key=[forward, backward].index), (str(pair), after)
            both += {forward, backward} <= set(after)
        assert ExecutionPlan.from_json(plan.to_json()).instructions == plan.instructions
    # kept whole for the step, a unit is gathered by its first compute only
    assert both or per == "step", "no pair gathers units for both of its chunks"


@pytest.mark.slow     # the default suite's budget: the numerics test above is the default check
def test_units_on_dualpipev_lower_the_predicted_peak():
    """The memory model (NOTE: Peak memory model) on every rank: per-unit gathers hold one or
    two layers whole at a time where the whole-stage gathers hold both chunks whole."""
    x = torch.randn(16, 16)
    y = torch.randint(0, 3, (16,))
    where = [(graphc.placement("cpu", [0, 1]), (graphc.sbp.split(0),))] * 2
    peaks = {}
    for unit_bytes in (0, 1):
        torch.manual_seed(0)
        graph = DualPipeGraph(Tower(width=64), unit_bytes)
        compiled = compile_graph(graph, [x, y], 4, where)
        assert any(isinstance(i, UnitGather) for i in compiled.plans[0].instructions) == bool(unit_bytes)
        model, costs = model_inputs(compiled, graph._optimizer), device_costs(compiled, "h100")
        peaks[unit_bytes] = [memory_peak(p, model.params[p.rank], costs).peak for p in compiled.plans]
    layer = 64 * 64 * torch.get_default_dtype().itemsize    # one layer's weight, whole
    assert all(whole - unit >= layer for unit, whole in zip(peaks[1], peaks[0])), peaks


def _gloo_dualpipev(rank, world):
    x_at = graphc.placement("cpu", [0, 1])
    torch.manual_seed(0)
    graph = DualPipeGraph(Tower(), unit_bytes=1)
    losses = []
    for x, y in batches():
        xs = graphc.to_global(rows(x, rank % 2, 2), placement=x_at, sbp=graphc.sbp.split(0))
        ys = graphc.to_global(rows(y, rank % 2, 2), placement=x_at, sbp=graphc.sbp.split(0))
        loss = graph(xs, ys).to_local()       # empty outside the loss's ranks
        losses.append(loss.item() if loss.numel() else None)
    return {"losses": losses, "state": graph.full_state_dict(),
            "units": sum(isinstance(i, UnitGather) for i in graph.plan.instructions)}


@pytest.mark.world
@pytest.mark.slow       # four gloo processes; the local world above is the default check
def test_units_on_dualpipev_on_gloo_equal_eager():
    """On gloo a unit is gathered into its parameters and reduced from its gradients rank by
    rank (NOTE: ZeRO rows in place): the pairs' units too."""
    ref_losses, ref_state = _eager()
    for rank, res in enumerate(run_world(_gloo_dualpipev, 4)):
        assert res["units"] > 0
        if rank in (0, 1):      # the loss's stage: the loss on its ranks
            assert_same_as_eager(res["losses"], res["state"], ref_losses, ref_state,
                                 f"gloo units dualpipev rank {rank}")
