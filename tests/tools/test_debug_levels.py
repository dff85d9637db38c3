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


def test_slow_passes_are_reported_at_a_terminal_only(monkeypatch):
    """Progress on long compiles: a pass slower than SLOW_PASS_SECONDS is logged when stderr
    is a terminal, and nothing is said otherwise (GRAPHC_DEBUG unset)."""
    import logging
    import sys

    import torch
    import torch.nn as nn

    import graphc
    from graphc import compiler

    class G(graphc.Graph):
        def __init__(self):
            super().__init__()
            self.model = nn.Linear(3, 2)

        def build(self, x):
            return self.model(x)

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("graphc.compile").addHandler(handler)
    monkeypatch.delenv("GRAPHC_DEBUG", raising=False)
    monkeypatch.setattr(compiler, "SLOW_PASS_SECONDS", 0.0)
    try:
        monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
        compiler.compile(G(), [torch.randn(4, 3)], 1)
        assert not any("took" in m for m in seen), seen
        monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
        compiler.compile(G(), [torch.randn(4, 3)], 1)
        assert any(m.startswith("pass trace_build took") for m in seen), seen
    finally:
        logging.getLogger("graphc.compile").removeHandler(handler)
