"""Plan templates (NOTE: Plan templates): a whole-world compile of a symmetric layout lowers
one row of replicas; every other rank's plan is its template renamed, equal to the plan that
rank lowers itself, and a fault planted in a template or in one rank is still caught."""
import copy
import os
import sys

import pytest

import graphc
from graphc import compiler
from graphc.errors import PlanError
from graphc.executable import input_specs
from graphc.passes.find_plan_symmetry import find_plan_symmetry
from graphc.plan.instructions import Collective, Recv, Send
from graphc.plan.plan import StageInfo
from graphc.plan.templates import PlanWorld
from graphc.plan.verify import verify_plans

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))
sys.path.insert(0, os.path.join(HERE, ".."))
import plan_scale  # noqa: E402
from transformer_models import GPTGraph, TinyGPT, token_batches  # noqa: E402


def _compile(monkeypatch, pp, dp, tp, m=4, ranks=None, clip=None):
    world = pp * dp * tp
    for k, v in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", world)):
        monkeypatch.setenv(k, str(v))
    graph, inputs = plan_scale.mlp_graph(pp, dp, tp, m)
    if clip is not None:
        graph.config.set_grad_clip_norm(clip)
    specs = input_specs(inputs)
    return compiler.compile(graph, [s.example() for s in specs], world, [s.layout for s in specs], ranks=ranks)


@pytest.mark.parametrize("pp,dp,tp", [(2, 4, 2), (1, 3, 2)], ids=["pp2xdp4xtp2", "dp3xtp2"])
def test_every_instance_is_the_plan_its_rank_lowers(monkeypatch, pp, dp, tp):
    world = pp * dp * tp
    templated = _compile(monkeypatch, pp, dp, tp)
    lowered = _compile(monkeypatch, pp, dp, tp, ranks=list(range(world)))
    assert isinstance(templated.plans, PlanWorld) and len(templated.plans.templates) == pp * tp
    assert not isinstance(lowered.plans, PlanWorld)
    for rank in range(world):
        assert str(templated.plans[rank]) == str(lowered.plan_for(rank)), f"rank {rank}"
        assert templated.plans[rank] == lowered.plan_for(rank)
    # a row's members share their renamed collectives, as list_collectives' plans do
    last = templated.plans.symmetry.row(dp - 1)
    shared = [ins for ins in templated.plans[last[0]].instructions if isinstance(ins, Collective)]
    assert not shared or any(ins is other for ins in shared
                             for other in templated.plans[last[1]].instructions)


def test_a_last_row_unlike_its_templates_lowers_every_rank(monkeypatch, caplog):
    # clipping counts a replicated parameter's norm on row 0 only: rows differ beyond renaming,
    # which the last row, lowered too, shows; then every rank is lowered and verified
    compiled = _compile(monkeypatch, 2, 3, 1, clip=1.0)
    assert not isinstance(compiled.plans, PlanWorld)
    assert any(r.name == "check_quotient" for r in compiled.history)
    lowered = _compile(monkeypatch, 2, 3, 1, ranks=list(range(6)), clip=1.0)
    assert [str(p) for p in compiled.plans] == [str(p) for p in lowered.plans]


def test_a_layout_without_the_symmetry_says_why(monkeypatch):
    compiled = _compile(monkeypatch, 2, 1, 1)     # one replica per stage: nothing to share
    assert not isinstance(compiled.plans, PlanWorld)
    said = next(r.text for r in compiled.history if r.name == "find_plan_symmetry")
    assert "one replica per stage" in said
    stages = [StageInfo(0, (0, 1))]
    assert "ZeRO stage 1" in find_plan_symmetry(stages, [(0, 1)], compiled.gm, compiled.programs, 1)
    assert "another order" in find_plan_symmetry([StageInfo(0, (1, 0))], [(0, 1)], compiled.gm,
                                                 compiled.programs, 0)


@pytest.fixture(scope="module")
def world():
    """A 128-rank world (8 stages x 16 replicas, plan_scale's MLP) as templates."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        compiled = _compile(monkeypatch, 8, 16, 1, m=8)
    assert isinstance(compiled.plans, PlanWorld) and len(compiled.plans.templates) == 8
    return compiled.plans


def test_a_fault_planted_in_one_template_of_a_large_world_is_caught(world):
    templates = copy.deepcopy(sorted(world.templates.values(), key=lambda p: p.rank))
    verify_plans(templates, len(world), quotient=True)
    # stage 5's template (rank 80) posts its first gradient receive before its first forward:
    # a crossed order, so stage 5 and stage 6 wait on each other on every row
    plan = templates[5]
    first_grad = next(i for i, ins in enumerate(plan.instructions) if isinstance(ins, Recv) and ins.direction == "B")
    plan.instructions.insert(0, plan.instructions.pop(first_grad))
    with pytest.raises(PlanError, match="rank 80, instruction #0: deadlock"):
        verify_plans(templates, len(world), quotient=True)


def test_a_fault_planted_in_one_rank_of_a_large_world_is_caught(world):
    plans = [world[r] for r in range(len(world))]
    verify_plans(plans, len(world))
    # rank 77 (stage 4, replica 13: an instance) sends two micro-batches in crossed order,
    # which its receiver (stage 5's replica 13, rank 93) is the first to see
    plan = copy.copy(plans[77])
    plan.instructions = list(plan.instructions)
    sends = [i for i, ins in enumerate(plan.instructions) if isinstance(ins, Send)]
    a, b = sends[0], sends[1]
    plan.instructions[a], plan.instructions[b] = plan.instructions[b], plan.instructions[a]
    plans[77] = plan
    with pytest.raises(PlanError, match=r"rank 93, instruction #\d+.*out of order"):
        verify_plans(plans, len(world))


def test_a_tied_pipeline_on_two_replicas_is_its_templates_renamed():
    # the embedding tied to the head: each replica's tie all-reduce joins its two stages (a
    # group inside one row), renamed with its row
    idx, targets = token_batches(1)[0]

    def compiled(ranks=None):
        where = [graphc.placement("cpu", ranks=[0, 1]), graphc.placement("cpu", ranks=[2, 3])]
        return compiler.compile(GPTGraph(TinyGPT(layers=2), None, where), [idx, targets], 4, ranks=ranks)
    templated, lowered = compiled(), compiled(list(range(4)))
    assert isinstance(templated.plans, PlanWorld) and sorted(templated.plans.templates) == [0, 2]
    assert [str(p) for p in templated.plans] == [str(p) for p in lowered.plans]
    tie = next(line for line in str(templated.plans[3]).splitlines() if "TIE_ALL_REDUCE" in line)
    assert "ranks=[1, 3] [model.wte.weight:" in tie and tie.endswith("as [model.lm_head.weight]")


@pytest.mark.slow
def test_the_8192_rank_world_is_128_templates_and_a_rank_alone_is_its_instance(monkeypatch):
    # issue 31's world (32 stages x 64 replicas x 4 tensor ranks): the middle rank's plan
    # lowered alone is its instance, printed text for printed text
    world = _compile(monkeypatch, 32, 64, 4, m=64)
    assert isinstance(world.plans, PlanWorld) and len(world.plans.templates) == 128
    alone = _compile(monkeypatch, 32, 64, 4, m=64, ranks=[4097])
    assert str(world.plans[4097]) == str(alone.plan_for(4097))
    assert sorted(world.plans._made) == [0, 4097]   # only the plans asked for were made
