"""`graphc plan` at 64 ranks (issue 12): benchmarks/plan_scale.py's MLP, pipeline 8 x data 4
x tensor 2 with 32 micro-batches, compiled, verified, summarised, charted and simulated in
plan mode. Facts, not timings (the benchmark measures those)."""
import json
import os
import re
import sys

import pytest

from graphc.plan.verify import verify_plans
from graphc.tools.simulate import engine as sim
from graphc.tools.costs import device_costs
from graphc.tools.dump import select_ranks
from graphc.modes import PlanModeExit, plan_mode
from graphc.tools.rows import fold_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))

import plan_scale  # noqa: E402


def plan_in_plan_mode(monkeypatch, out, pp, dp, tp, m, simulate="h100", ranks=None):
    """What `graphc plan --nproc N --simulate h100` does with the MLP script: the compiled graph."""
    world = pp * dp * tp
    for k, v in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", world)):
        monkeypatch.setenv(k, str(v))
    graph, inputs = plan_scale.mlp_graph(pp, dp, tp, m)
    with plan_mode(world, out, simulate, True, ranks):
        with pytest.raises(PlanModeExit):
            graph(*inputs)
    return graph.compiled


@pytest.mark.slow
def test_plan_64_ranks(monkeypatch, tmp_path, capsys):
    out = str(tmp_path / "plans")
    compiled = plan_in_plan_mode(monkeypatch, out, 8, 4, 2, 32)
    said = capsys.readouterr().out
    plans = compiled.plans
    assert len(plans) == 64 and len(compiled.stages) == 8 and compiled.num_microbatches == 32
    verify_plans(plans)
    assert [list(s.ranks) for s in compiled.stages] == [list(range(8 * s, 8 * s + 8)) for s in range(8)]

    # --ranks: 64 ranks is not "below 64", so the first and last rank of each stage
    firsts_lasts = sorted(r for s in range(8) for r in (8 * s, 8 * s + 7))
    written = sorted(int(f[4:-5]) for f in os.listdir(out) if f.startswith("rank") and f.endswith(".json"))
    assert written == firsts_lasts
    assert "plans written for 16 of 64 ranks" in said
    assert select_ranks("0,7,-1", compiled)[0] == [0, 7, 63]
    assert select_ranks("all", compiled)[0] == list(range(64))
    for r in (0, 63):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            assert json.load(f)["rank"] == r

    # stages.txt: one block per stage; ranks of a stage run one instruction sequence
    with open(os.path.join(out, "stages.txt")) as f:
        summary = f.read()
    assert summary.startswith("# graphc plan summary: MLPGraph, 64 rank(s), 8 stage(s), schedule=1f1b, "
                              "32 micro-batch(es), training")
    for s in range(8):
        assert f"stage {s}: ranks {8 * s}-{8 * s + 7} (8 rank(s))" in summary
        assert f"plans written: rank{8 * s}.txt, rank{8 * s + 7}.txt" in summary
    assert "instruction sequences" not in summary
    assert "130 instructions a step: 32 F, 32 B, 32 SEND, 32 RECV, 1 ALL_REDUCE, 1 OPTIMIZER_STEP" in summary
    # the gradient all-reduce of every stage spans its 4 data-parallel replicas
    assert summary.count("1 all_reduce over 4 ranks") == 8
    # middle stages talk to both neighbours
    assert re.search(r"stage 2: .*\n.*\n    transfers a step: sends [0-9.]+ MiB to stage 1, sends "
                     r"[0-9.]+ MiB to stage 3, receives [0-9.]+ MiB from stage 1, receives", summary)

    # charts and the trace: one row per stage (its 8 ranks run one timeline)
    for name in ("schedule.png", "schedule.svg", "simulated.png", "simulated.svg", "simulation.txt"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "simulated_trace.json")) as f:
        trace = json.load(f)
    rows = [e["args"]["name"] for e in trace["traceEvents"]
            if e.get("ph") == "M" and e.get("name") == "process_name"]
    assert rows == [f"simulated ranks {8 * s}-{8 * s + 7}, stage {s}" for s in range(8)]
    with open(os.path.join(out, "simulation.txt")) as f:
        table = f.read()
    # simulated by its 16 templates (8 stages x 2 tensor columns), a table row for each class
    assert sum(1 for line in table.splitlines() if line.split()[:1] and line.split()[0].isdigit()) == 16
    assert "simulated as classes: 64 ranks in 16" in table

    # the folded simulation (one rank per stage runs) equals the one of every rank
    costs = device_costs(compiled, "h100")
    folded = sim._Simulation(plans, costs, 2)
    folded.run()
    assert len(folded.running) == 8
    every = sim._Simulation(plans, costs, 2, fold=False)
    every.run()
    for r in range(64):
        assert folded.starts[r].tobytes() == every.starts[r].tobytes(), r
        assert folded.ends[r].tobytes() == every.ends[r].tobytes(), r
    result = folded.result()
    assert fold_ranks(result.timeline) == [list(range(8 * s, 8 * s + 8)) for s in range(8)]
    assert result.table() == every.result().table()


@pytest.mark.slow
def test_plan_8192_ranks_reads_the_templates(monkeypatch, tmp_path):
    """`graphc plan --nproc 8192 --simulate h100` with its charts (issue 31): the chart and the
    simulation run on the 128 templates (NOTE: Simulated classes); the only plans made from
    them are the 64 written to files (the first and last rank of each stage)."""
    out = str(tmp_path / "plans")
    compiled = plan_in_plan_mode(monkeypatch, out, *plan_scale.SIZES[8192])
    world = compiled.plans
    assert len(world) == 8192 and len(world.templates) == 128
    assert world.instances_made <= 64
    with open(os.path.join(out, "simulation.txt")) as f:
        table = f.read()
    assert "simulated as classes: 8192 ranks in 128" in table
    rows = [line for line in table.splitlines() if line.split()[:1] and line.split()[0].isdigit()]
    assert len(rows) == 128 and rows[1].endswith("1, 5, ..., 253 (64 ranks)")
    for name in ("schedule.png", "schedule.svg", "simulated.png", "simulated.svg", "simulated_trace.json"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
