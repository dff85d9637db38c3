"""collect_stages: set_stage's stages numbered 0..p-1 without gaps, each placement inside the
world, one placement per stage, no two stages sharing a rank; one stage on every rank
without set_stage. Built from CompileSpec values: nothing is traced."""
import pytest
import torch
import torch.nn as nn

import graphc
from graphc.compiler import CompileSpec, ModuleSpec
from graphc.errors import GraphcError
from graphc.passes.collect_stages import collect_stages, traced_autocast
from graphc.plan.plan import StageInfo
from graphc.sbp.declared import DeclaredLayouts


def spec(modules, root=None, schedule="1f1b"):
    return CompileSpec(name="G", source_file=None, root=root or nn.Linear(2, 2),
                       modules={name: ModuleSpec(sid, where) for name, (sid, where) in modules.items()},
                       declared=DeclaredLayouts(), pipeline_schedule=schedule)


def on(*ranks):
    return graphc.placement("cpu", list(ranks))


def test_without_set_stage_one_stage_runs_on_every_rank():
    stages, of_module = collect_stages(spec({}), 3)
    assert stages == [StageInfo(0, (0, 1, 2), "cpu")] and of_module == {}


def test_modules_without_a_stage_id_do_not_make_stages():
    """A module config that only sets checkpointing (stage_id None) names no stage."""
    stages, of_module = collect_stages(spec({"model.a": (None, None)}), 2)
    assert stages == [StageInfo(0, (0, 1), "cpu")] and of_module == {}


def test_stages_in_id_order_with_their_placements_and_modules():
    modules = {"model.head": (2, on(3)), "model.a": (0, on(0, 1)), "model.b": (1, on(2)),
               "model.c": (1, on(2))}
    stages, of_module = collect_stages(spec(modules), 4)
    assert stages == [StageInfo(0, (0, 1), "cpu"), StageInfo(1, (2,), "cpu"), StageInfo(2, (3,), "cpu")]
    assert of_module == {"model.head": 2, "model.a": 0, "model.b": 1, "model.c": 1}


def test_a_gap_in_the_stage_ids_is_refused_with_the_missing_ids():
    with pytest.raises(GraphcError, match=r"0, 1, \.\.\., p-1 without gaps; found \[0, 2\] \(missing \[1\]\)"):
        collect_stages(spec({"a": (0, on(0)), "b": (2, on(1))}), 2)


def test_two_placements_for_one_stage_name_both_modules():
    with pytest.raises(GraphcError, match="stage 0 is given two placements: module 'a' .* module 'b'"):
        collect_stages(spec({"a": (0, on(0)), "b": (0, on(1))}), 2)


def test_a_rank_outside_the_world_names_the_module_and_the_world():
    with pytest.raises(GraphcError, match=r"module 'b': placement .* names rank\(s\) \[2\], but the world "
                                          r"has 2 rank\(s\) \(0\.\.1\)"):
        collect_stages(spec({"a": (0, on(0)), "b": (1, on(1, 2))}), 2)


def test_stages_whose_ranks_overlap_without_being_equal_are_refused():
    with pytest.raises(GraphcError, match=r"stage 1 runs on ranks \[1, 2\], which overlap the ranks \[0, 1\]"):
        collect_stages(spec({"a": (0, on(0, 1)), "b": (1, on(1, 2))}), 3)


def test_stages_on_the_same_ranks_are_chunks_of_one_pipeline_rank():
    """Inference layout only (training layouts are check_layout's): same ranks, two chunks."""
    stages, _ = collect_stages(spec({"a": (0, on(0)), "b": (1, on(1)), "c": (2, on(0))}), 2)
    assert [s.ranks for s in stages] == [(0,), (1,), (0,)]


def test_autocast_device_type_follows_the_stages():
    cpu = [StageInfo(0, (0,), "cpu")]
    assert traced_autocast(cpu, None) is None
    assert traced_autocast(cpu, torch.bfloat16) == ("cpu", torch.bfloat16)
    assert traced_autocast(cpu + [StageInfo(1, (1,), "cuda")], torch.float16) == ("cuda", torch.float16)
