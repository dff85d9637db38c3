"""Measured and modelled costs, and the chart."""
import pytest
import torch

from graphc import GraphcError, compiler
from graphc.tools.chart import draw_timeline
from graphc.tools.costs import DEVICES, device_costs, measure_costs
from graphc.tools.simulate import simulate
from models import PipelineGraph, SkipNet


@pytest.fixture(scope="module")
def compiled_graph():
    model = SkipNet(2, d=64)
    graph = PipelineGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation=2)
    return graph, compiler.compile(graph, [torch.randn(32, 64), torch.randint(0, 5, (32,))], 2)


def test_measure_costs_leaves_gradients_alone(compiled_graph):
    graph, compiled = compiled_graph
    costs = measure_costs(compiled, graph._optimizer, repeats=2)
    assert all(costs.forward[s] > 0 and costs.backward[s] > 0 for s in (0, 1))
    assert all(costs.optimizer[s] > 0 for s in (0, 1))
    # saved activations of one micro-batch (16 x 64 floats and more), weights excluded
    assert all(16 * 64 * 4 <= costs.activation_bytes[s] < 64 * 64 * 4 * 8 for s in (0, 1))
    assert all(p.grad is None for p in graph._root.parameters())


def test_device_costs_from_flops(compiled_graph):
    _, compiled = compiled_graph
    # compute bound; the float64 model's FLOPs run at the preset's float32 rate
    costs = device_costs(compiled, "h100", tflops=1e-6, fp32_tflops=1e-6, efficiency=1.0)
    # stage 0 forward is at least its linear: 2 * 16 rows * 64 * 64 FLOPs at 1e6 FLOP/s
    assert costs.forward[0] >= 2 * 16 * 64 * 64 / 1e6
    assert costs.backward[0] == pytest.approx(2 * costs.forward[0])
    assert costs.bandwidth == DEVICES["h100"].link_gbps * 1e9
    with pytest.raises(GraphcError, match="unknown device preset"):
        device_costs(compiled, "tpu9")


def test_chart_files(tmp_path, compiled_graph):
    _, compiled = compiled_graph
    result = simulate(compiled.plans, device_costs(compiled, "a100"))
    paths = draw_timeline(result.timeline, str(tmp_path / "chart"), "test chart")
    assert [p[-3:] for p in paths] == ["png", "svg"]
    with open(paths[0], "rb") as f:
        assert f.read(4) == b"\x89PNG"
    with open(paths[1]) as f:
        svg = f.read()
    assert "test chart" in svg and "rank 1" in svg


def test_cost_measurement_reports_progress_with_an_eta_at_a_terminal(monkeypatch):
    import logging
    import sys

    from graphc.tools import costs

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("graphc.plan").addHandler(handler)
    try:
        monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
        costs._progress("measured", 1, 4, 2.0)
        assert seen == []
        monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
        costs._progress("measured", 1, 4, 2.0)
        assert seen == ["measured stage 1/4 (2.0 s, about 6.0 s left)"]
    finally:
        logging.getLogger("graphc.plan").removeHandler(handler)
