"""The simulator's CPU step time for the pipeline example is within 25% of a real 2-rank run.

Measured: examples/pipeline.py's graph (batch 64, 4 micro-batches, 1F1B) on 2 spawned
processes (one torch thread each, as torchrun sets OMP_NUM_THREADS=1), with the
transport under test (GRAPHC_P2P=shm or gloo); each rank's step time is the median over
the steps after warm-up of its graph() calls; the slower rank counts.

Predicted, before and apart from that run: measure_costs() replays each stage's compute
instructions here (1 thread) and measures the same transport between two processes
(per-send / per-recv CPU, latency, a waiting receiver's polling delay); simulate() runs
STEADY consecutive steps with the machine's core count and reports the steady-state period.
No constant is fitted to the run being predicted.

    PYTHONPATH=tests python tests/tools/measure_step_time.py [shm|gloo ...]

As a test: tests/tools/test_step_time_accuracy.py (-m slow).
"""
import importlib.util
import os
import statistics
import sys
import time

import torch

from helpers import run_world

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "pipeline.py")
BATCH, ACC, STEPS, WARMUP, STEADY = 64, 4, 40, 5, 8


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
    return statistics.median(times[WARMUP:]), graph._runtime.p2p.kinds


def predict(transport: str):
    """(SimResult, CostModel) for the example, costs measured here for `transport`."""
    from graphc import compiler
    from graphc.tools.costs import measure_costs
    from graphc.tools.simulate import simulate
    graph, x, y = _make(_example())
    compiled = compiler.compile(graph, [x, y], 2)
    costs = measure_costs(compiled, graph._optimizer, repeats=9, transport=transport)
    return simulate(compiled.plans, costs, steps=STEADY, cores=os.cpu_count()), costs


def measure(transport: str) -> float:
    saved = os.environ.get("GRAPHC_P2P")
    os.environ["GRAPHC_P2P"] = transport        # spawned ranks inherit it
    try:
        results = run_world(_measure, 2)
    finally:
        if saved is None:
            os.environ.pop("GRAPHC_P2P")
        else:
            os.environ["GRAPHC_P2P"] = saved
    kinds = {k for _, ks in results for k in ks.values()} or {"gloo"}   # P2P.kinds omits gloo
    assert kinds == {transport}, f"the run used {kinds}, not {transport}"
    return max(t for t, _ in results)


def compare(transport: str):
    load = os.getloadavg()[0]
    result, costs = predict(transport)
    measured = measure(transport)
    return result.step_time, measured, load, result, costs


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for kind in sys.argv[1:] or ["shm", "gloo"]:
        p, m, load, result, costs = compare(kind)
        ms = lambda d: {k: round(v * 1e3, 3) for k, v in d.items()}  # noqa: E731
        print(f"[{kind}] costs: forward {ms(costs.forward)} backward {ms(costs.backward)} "
              f"optimizer {ms(costs.optimizer)} ms; send {costs.send_overhead * 1e6:.1f} us + "
              f"{costs.send_per_byte * 1e9:.3f} ns/B, recv {costs.recv_overhead * 1e6:.1f} us + "
              f"{costs.recv_per_byte * 1e9:.3f} ns/B, latency {costs.latency * 1e6:.1f} us, "
              f"poll delay {[(round(w * 1e3, 2), round(d * 1e3, 3)) for w, d in costs.poll_delay]} ms")
        print(f"[{kind}] first step {result.first_step_time * 1e3:.2f} ms, steady state "
              f"{p * 1e3:.2f} ms; measured {m * 1e3:.2f} ms; error {abs(p - m) / m:.1%}; "
              f"load before {load:.2f}, after {os.getloadavg()[0]:.2f}", flush=True)
