"""The simulator's step time for the CPU pipeline example is within 25% of a real 2-rank run.

Measured: examples/pipeline.py's graph on 2 spawned gloo processes (one thread each, as
torchrun sets OMP_NUM_THREADS=1), median over steps after warm-up of each rank's step
time, the slower rank counting. Predicted: simulate() over the compiled plans with costs
measured here by measure_costs (1 thread) and the default loopback link model.
"""
import importlib.util
import os
import statistics
import time

import pytest
import torch

from helpers import run_world

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "pipeline.py")
BATCH, ACC, STEPS, WARMUP = 64, 4, 30, 5


def _example():
    spec = importlib.util.spec_from_file_location("pipeline_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _make(ex):
    import graphc
    torch.manual_seed(0)
    p0, p1 = graphc.placement("cpu", ranks=[0]), graphc.placement("cpu", ranks=[1])
    model = ex.PipelineModule()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    graph = ex.PipelineGraph(model, opt, p0, p1, ACC, "1f1b")
    return graph, torch.randn(BATCH, 1, 28, 28), torch.randint(0, 10, (BATCH,))


def _measure(rank, world):
    graph, x, y = _make(_example())
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        graph(x, y)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[WARMUP:])


def predicted_and_measured():
    from graphc import compiler
    from graphc.tools.costs import measure_costs
    from graphc.tools.simulate import simulate
    graph, x, y = _make(_example())
    compiled = compiler.compile(graph, [x, y], 2)
    predicted = simulate(compiled.plans, measure_costs(compiled, graph._optimizer, repeats=9))
    measured = max(run_world(_measure, 2))
    return predicted.step_time, measured


@pytest.mark.slow
def test_simulated_step_time_within_25_percent_of_measured():
    predicted, measured = predicted_and_measured()
    err = abs(predicted - measured) / measured
    print(f"predicted {predicted * 1e3:.2f} ms, measured {measured * 1e3:.2f} ms, error {err:.1%}")
    assert err <= 0.25, f"predicted {predicted * 1e3:.2f} ms vs measured {measured * 1e3:.2f} ms"


if __name__ == "__main__":
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p, m = predicted_and_measured()
    print(f"predicted {p * 1e3:.2f} ms, measured {m * 1e3:.2f} ms, error {abs(p - m) / m:.1%}")
