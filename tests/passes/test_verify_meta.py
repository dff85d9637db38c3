"""verify_meta (GRAPHC_DEBUG=5): a step that breaks a node annotation is named, with the node,
the key and the graph marked `<-- ERROR HERE` (See NOTE: Annotation verifier)."""
import re
from pathlib import Path

import pytest
import torch

import graphc.meta as meta
from graphc import compiler
from graphc.meta import META_AUTOCAST, META_SBP, META_STAGE, META_STAGE_WHY, META_TENSOR
from graphc.passes.verify_meta import ESTABLISHED_BY, SCHEMAS, AnnotationError
from models import PipelineGraph, SkipNet

X, Y = torch.randn(8, 16), torch.randint(0, 5, (8,))


def _compile():
    return compiler.compile(PipelineGraph(SkipNet(2), None, accumulation=2), [X, Y], 2)


def _seed(monkeypatch, step, corrupt):
    """compile() runs `step` as itself and then `corrupt(gm)`: a pass with a bug."""
    real = getattr(compiler, step)

    def broken(*args):
        out = real(*args)
        corrupt(out)
        return out
    monkeypatch.setattr(compiler, step, broken)


def _node(gm, name):
    return next(n for n in gm.graph.nodes if n.name == name)


def _raises(monkeypatch, *parts):
    monkeypatch.setenv("GRAPHC_DEBUG", "5")
    with pytest.raises(AnnotationError) as info:
        _compile()
    text = str(info.value)
    for part in parts:
        assert part in text, text
    marked = [line for line in text.splitlines() if line.endswith("<-- ERROR HERE")]
    assert len(marked) == 1, text
    return text, marked[0]


def test_a_corrupted_annotation_names_the_pass_node_and_key(monkeypatch):
    def out_of_mesh(gm):  # an SBP signature with two SBPs on a 1-D mesh
        n = _node(gm, "model_head")
        sig = n.meta[META_SBP]
        n.meta[META_SBP] = type(sig)(sig.mesh, sig.out * 2, sig.ins, sig.fallback)
    _seed(monkeypatch, "localize_ops", out_of_mesh)
    text, marked = _raises(monkeypatch, "compile step 'localize_ops' broke annotation graphc_sbp of "
                           "node 'model_head'", "one SBP per mesh axis (1)")
    assert "%model_head" in marked


def test_a_dropped_annotation_names_the_pass_that_dropped_it(monkeypatch):
    _seed(monkeypatch, "insert_boxing", lambda gm: _node(gm, "model_head").meta.pop(META_TENSOR))
    text, marked = _raises(monkeypatch, "compile step 'insert_boxing' broke annotation graphc_tensor",
                           "dropped: the node carried it before this step")
    assert "%model_head" in marked


def test_a_node_the_pass_promised_but_missed_is_named(monkeypatch):
    _seed(monkeypatch, "annotate_stages", lambda gm: [n.meta.pop(META_STAGE) for n in gm.graph.nodes
                                                      if n.name == "model_head"])
    _raises(monkeypatch, "compile step 'annotate_stages' broke annotation graphc_stage of node "
            "'model_head': missing: the step promises it on this node")


def test_a_node_a_later_pass_adds_without_a_lasting_annotation_is_named(monkeypatch):
    """annotate_stages gives every node a stage; a later pass that adds a node gives it one too."""
    def add_node(gm):
        head = _node(gm, "model_head")
        with gm.graph.inserting_after(head):
            gm.graph.call_function(torch.neg, (head,))
    _seed(monkeypatch, "localize_ops", add_node)
    _, marked = _raises(monkeypatch, "compile step 'localize_ops' broke annotation graphc_stage of "
                        "node 'neg': missing: 'annotate_stages' gave it to nodes like this one, and "
                        "every later step keeps it")
    assert "%neg" in marked


def test_a_stage_out_of_range_is_caught_after_the_stages_are_final(monkeypatch):
    _seed(monkeypatch, "decompose_modules", lambda gm: _node(gm, "model_head").meta.update({META_STAGE: 2}))
    _raises(monkeypatch, "compile step 'decompose_modules' broke annotation graphc_stage",
            "expected a stage index below the 2 stage(s), found 2")


def test_stage_programs_are_checked_too(monkeypatch):
    """Steps of the split phase return stage programs: their modules' nodes are checked."""
    def autocast_as_dtype(programs):
        node = next(n for n in programs[1].module.graph.nodes if n.name == "model_head")
        node.meta[META_AUTOCAST] = (("cpu", torch.bfloat16),)
    _seed(monkeypatch, "insert_autocast_modes", autocast_as_dtype)
    _, marked = _raises(monkeypatch, "compile step 'insert_autocast_modes' broke annotation "
                        "graphc_autocast of node 'model_head'", "(device type, dtype name) pairs of str")
    assert "%model_head" in marked


def test_checks_run_at_level_5_only(monkeypatch):
    """A harmless corruption (the stage rule's name as an int) compiles below level 5."""
    _seed(monkeypatch, "seed_random_ops", lambda gm: _node(gm, "model_head").meta.update({META_STAGE_WHY: 3}))
    monkeypatch.setenv("GRAPHC_DEBUG", "4")
    _compile()
    _raises(monkeypatch, "compile step 'seed_random_ops' broke annotation graphc_stage_why",
            "expected str, found 3")


def test_a_clean_compile_passes_every_check(monkeypatch):
    monkeypatch.setenv("GRAPHC_DEBUG", "5")
    assert len(_compile().plans) == 2


def test_every_node_key_of_meta_has_a_schema():
    """graphc/meta.py names the keys; a key kept on nodes (not on gm.meta) has a schema here."""
    source = Path(meta.__file__).read_text()
    node_keys = {getattr(meta, name) for name, where in
                 re.findall(r"^(META_\w+) = \"\w+\"\s+# (gm\.meta)?", source, re.M) if not where}
    assert node_keys and node_keys <= set(SCHEMAS), sorted(node_keys - set(SCHEMAS))
    assert {key for promises in ESTABLISHED_BY.values() for key, _ in promises} <= set(SCHEMAS)


def test_every_promising_step_is_a_step_of_compile():
    names = {r.name for r in _compile().history}
    assert set(ESTABLISHED_BY) <= names, sorted(set(ESTABLISHED_BY) - names)
