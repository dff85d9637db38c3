"""check_layout: a training graph's stages sit on ranks its pipeline schedule can run (one
stage per rank, interleaved or V); a refusal names a module of each stage. Nothing changes."""
import pytest
import torch

from graphc.errors import GraphcError
from graphc.passes.check_layout import check_layout
from graphc.plan.plan import StageInfo
from helpers import compile_graph
from models import PipelineGraph, SkipNet


def stages_on(*ranks):
    return [StageInfo(s, (r,)) for s, r in enumerate(ranks)]


@pytest.mark.parametrize("schedule, ranks", [
    ("1f1b", (0, 1, 2)), ("gpipe", (0, 1)),
    ("interleaved_1f1b", (0, 1, 0, 1)),     # stage s on rank s mod p
    ("zbv", (0, 1, 1, 0)), ("dualpipev", (0, 1, 1, 0)),   # stages s and 2p-1-s on one rank
])
def test_layouts_the_schedule_runs_pass_unchanged(schedule, ranks):
    stages = stages_on(*ranks)
    assert check_layout(stages, {"model.a": 0}, schedule) is None
    assert stages == stages_on(*ranks)


def test_several_stages_per_rank_under_a_one_stage_schedule_name_a_module_of_each():
    of_module = {"model.b": 1, "model.a": 0, "model.c": 2, "model.a2": 0}
    with pytest.raises(GraphcError) as err:
        check_layout(stages_on(0, 1, 0), of_module, "1f1b")
    text = str(err.value)
    assert "'1f1b' runs one stage per rank" in text
    # the first module of each stage, by name
    assert text.endswith("(stage 0: module 'model.a', stage 1: module 'model.b', stage 2: module 'model.c')")


def test_the_interleaved_layout_needs_stage_s_on_rank_s_mod_p():
    with pytest.raises(GraphcError, match="interleaved"):
        check_layout(stages_on(0, 0, 1, 1), {}, "interleaved_1f1b")


def test_a_refusal_without_configured_modules_adds_no_module_list():
    with pytest.raises(GraphcError) as err:
        check_layout(stages_on(0, 1, 0), {}, "gpipe")
    assert "module '" not in str(err.value)


def test_compile_refuses_a_training_layout_the_schedule_cannot_run():
    """SkipNet(3) on ranks 0, 1, 2 trains under 1f1b; ZB-V needs two stages per rank."""
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    assert compile_graph(PipelineGraph(SkipNet(3), torch.optim.SGD(SkipNet(3).parameters(), lr=0.1)),
                         [x, y], 3).stages == stages_on(0, 1, 2)
    with pytest.raises(GraphcError, match=r"stage 0: module 'model\.blocks\.0'"):
        model = SkipNet(3)
        compile_graph(PipelineGraph(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    schedule="zbv"), [x, y], 3)
