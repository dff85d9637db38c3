"""GRAPHC_DEBUG=1..4: summary, pass timings, per-rank plans, every pass's fx graph."""
import pytest
import torch

from graphc import compiler
from models import PipelineGraph, SkipNet

MARKS = {1: "[rank 0] graphc.compile: compiled PipelineGraph", 2: "graphc.compile: pass trace_build:",
         3: "# graphc plan: rank 1 of 2", 4: "# Constructed by trace_build"}


@pytest.mark.parametrize("level", [0, 1, 2, 3, 4])
def test_debug_level_prints_its_own_and_lower_levels(level, monkeypatch, capsys):
    monkeypatch.setenv("GRAPHC_DEBUG", str(level))
    graph = PipelineGraph(SkipNet(2), None, accumulation=2)
    compiler.compile(graph, [torch.randn(8, 16), torch.randint(0, 5, (8,))], 2)
    out = capsys.readouterr().err          # the graphc.compile logger's stderr handler
    for k, mark in MARKS.items():
        assert (mark in out) == (k <= level), f"level {level}: {mark!r} {'missing' if k <= level else 'printed'}"
