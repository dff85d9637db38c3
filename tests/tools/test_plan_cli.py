"""`graphc plan`: compiles a script's graphs for N ranks in one process and writes them."""
import glob
import json
import os
import subprocess
import sys

import pytest

from graphc.cli import main
from graphc.plan.instructions import Backward, Forward, Recv, Send
from graphc.plan.plan import ExecutionPlan
from graphc.plan.schedules import compute_order
from graphc.plan.verify import verify_plans
from graphc.tools.plan_cli import split_argv

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "scripts", "skipnet_train.py")
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.py")))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_plans(folder, n):
    plans = []
    for r in range(n):
        with open(os.path.join(folder, f"rank{r}.json")) as f:
            d = json.load(f)
        assert d["format"] == "graphc.plan/1" and d["rank"] == r and d["world_size"] == n
        plan = ExecutionPlan.from_json(d)
        with open(os.path.join(folder, f"rank{r}.txt")) as f:
            assert ExecutionPlan.parse(f.read()).instructions == plan.instructions
        plans.append(plan)
    return plans


def check_pairing(plans):
    """The k-th send from a to b carries what the k-th recv on b from a expects."""
    for p in plans:
        for q in plans:
            sends = [i for i in p.instructions if isinstance(i, Send) and i.peer == q.rank]
            recvs = [i for i in q.instructions if isinstance(i, Recv) and i.peer == p.rank]
            assert len(sends) == len(recvs), (p.rank, q.rank)
            for s, r in zip(sends, recvs):
                assert (s.microbatch, s.direction, s.tensors) == (r.microbatch, r.direction, r.tensors)


def check_files(folder, n, stages, chart=True):
    for r in range(n):
        for ext in ("json", "txt"):
            assert os.path.getsize(os.path.join(folder, f"rank{r}.{ext}")) > 0
    for s in range(stages):
        with open(os.path.join(folder, f"stage{s}.py")) as f:
            assert "def forward(self" in f.read()
    with open(os.path.join(folder, "guards.txt")) as f:   # the values it was compiled under
        guards = f.read().splitlines()
    assert guards[0].startswith("# ") and "torch.is_grad_enabled() == True" in guards
    if not chart:
        return
    with open(os.path.join(folder, "schedule.png"), "rb") as f:
        assert f.read(8) == PNG_MAGIC
    with open(os.path.join(folder, "schedule.svg")) as f:
        assert "<svg" in f.read()


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_plan_writes_every_rank_with_the_schedule(tmp_path, n, schedule):
    out = str(tmp_path / "plans")
    # graphc's options after the script's; the script's own --out goes after `--`
    chart = [] if n == 4 else ["--no-chart"]     # charts cost seconds: draw one size
    rc = main(["plan", SCRIPT, "--stages", str(n), "--schedule", schedule, "--nproc", str(n),
               "--out", out, *chart, "--", "--out", "mine"])
    assert rc == 0
    check_files(out, n, n, chart=not chart)
    plans = load_plans(out, n)
    verify_plans(plans)
    check_pairing(plans)
    for p in plans:
        compute = [i for i in p.instructions if isinstance(i, (Forward, Backward))]
        assert compute == compute_order(schedule, p.rank, n, n, 4), f"rank {p.rank}"
        assert p.schedule == schedule and p.num_microbatches == 4


# script arguments an example needs ("{tmp}": a scratch folder), after `--`
EXAMPLE_ARGS = {"train_resume.py": ["--ckpt-dir", "{tmp}"],
                "gpt.py": ["--pp", "2", "--steps", "1"],       # its first documented launch
                "hf_llama.py": ["--pp", "2", "--steps", "1"],
                "long_context.py": ["--cp", "4", "--steps", "1", "--seq", "32", "--layers", "1"],
                "moe.py": ["--ep", "2", "--steps", "1"],
                "resnet.py": ["--pp", "2", "--steps", "1"]}


def _world_sizes(example):
    """2, 4 and 8 ranks where the example's placements follow the world size (pipeline.py
    places stages on ranks 0 and 1; the others idle); else its documented torchrun size."""
    with open(example) as f:
        text = f.read()
    if os.path.basename(example) == "pipeline.py":
        return [2, 4, 8]
    import re
    m = re.search(r"--nproc_per_node (\d+)", text)
    return [int(m.group(1)) if m else 2]


CASES = [(e, n) for e in EXAMPLES for n in _world_sizes(e)]


@pytest.mark.parametrize("example,n", CASES, ids=[f"{os.path.basename(e)}-{n}" for e, n in CASES])
def test_plan_on_every_example(tmp_path, example, n):
    out = str(tmp_path / "plans")
    extra = [a.format(tmp=tmp_path) for a in EXAMPLE_ARGS.get(os.path.basename(example), [])]
    assert main(["plan", example, "--nproc", str(n), "--out", out, "--", *extra]) == 0
    plans = load_plans(out, n)
    stages = len(glob.glob(os.path.join(out, "stage*.py")))
    check_files(out, n, stages)
    verify_plans(plans)
    check_pairing(plans)


def test_cuda_placements_compile_without_a_gpu(tmp_path):
    out = str(tmp_path / "plans")
    assert main(["plan", SCRIPT, "--stages", "2", "--device", "cuda", "--nproc", "2", "--out", out]) == 0
    plans = load_plans(out, 2)
    assert {s.device_type for s in plans[0].stages} == {"cuda"}


def test_each_graph_of_a_script_gets_its_folder(tmp_path):
    out = str(tmp_path / "plans")
    assert main(["plan", SCRIPT, "--eval-graph", "--nproc", "2", "--out", out]) == 0
    train = load_plans(out, 2)
    (second,) = glob.glob(os.path.join(out, "graph1_EvalGraph"))
    evals = load_plans(second, 2)
    assert train[0].training and not evals[0].training
    assert all(isinstance(i, (Forward, Send, Recv)) for p in evals for i in p.instructions)


def test_script_without_graph_is_an_error(tmp_path, capsys):
    rc = main(["plan", os.path.join(HERE, "scripts", "no_graph.py"), "--nproc", "2", "--out",
               str(tmp_path)])
    assert rc == 1
    assert "without compiling a graphc.Graph" in capsys.readouterr().err


def test_split_argv_keeps_script_options_in_order():
    mine, script, theirs = split_argv(["--nproc", "2", "t.py", "--lr", "3", "--out", "d",
                                       "--simulate", "--steps", "5", "--", "--out", "x"])
    assert script == "t.py"
    assert mine == ["--nproc", "2", "--out", "d", "--simulate"]
    assert theirs == ["--lr", "3", "--steps", "5", "--out", "x"]


def test_python_dash_m_graphc_plan(tmp_path):
    out = str(tmp_path / "plans")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "graphc", "plan", SCRIPT, "--nproc", "2", "--out",
                          out, "--no-chart"], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert "plans verified" in res.stdout
    load_plans(out, 2)
    assert not os.path.exists(os.path.join(out, "schedule.png"))


def test_plan_environment_variables_with_plain_python(tmp_path):
    """GRAPHC_PLAN_NPROC/OUT plan a script run as `python train.py`: nobody installs the
    writer, so plan mode finds the tools' one by name (NOTE: Plan-mode writer); the first
    step then ends the script with PlanModeExit."""
    out = str(tmp_path / "plans")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GRAPHC_PLAN_NPROC="2", GRAPHC_PLAN_OUT=out, GRAPHC_PLAN_SIMULATE="h100")
    res = subprocess.run([sys.executable, SCRIPT, "--eval-graph"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 1 and "PlanModeExit: graphc plan: stopped before PipelineGraph's " \
        "first step" in res.stderr, res.stderr
    assert "plans verified" in res.stdout
    load_plans(out, 2)
    load_plans(os.path.join(out, "graph1_EvalGraph"), 2)
    assert os.path.exists(os.path.join(out, "simulated_trace.json"))


def test_plan_gpt_on_eight_ranks_with_chart(tmp_path):
    """The GPT example as pipeline x tensor x data 2x2x2, planned and simulated on one machine
    (collectives run shapes-only while FLOPs are counted: NOTE: Shapes only)."""
    out = str(tmp_path / "plans")
    gpt = os.path.join(ROOT, "examples", "gpt.py")
    assert main(["plan", gpt, "--nproc", "8", "--out", out, "--simulate", "h100", "--",
                 "--pp", "2", "--tp", "2", "--dp", "2", "--steps", "1"]) == 0
    assert os.path.exists(os.path.join(out, "simulation.txt")), os.listdir(out)
    plans = load_plans(out, 8)
    check_files(out, 8, len(glob.glob(os.path.join(out, "stage*.py"))))
    verify_plans(plans)
    assert "fallback" not in "".join(str(p) for p in plans)


@pytest.mark.parametrize("example,n", [("ddp.py", 2), ("hybrid.py", 4)])
def test_simulate_data_and_hybrid_examples(tmp_path, example, n):
    out = str(tmp_path / "plans")
    assert main(["plan", os.path.join(ROOT, "examples", example), "--nproc", str(n), "--out", out,
                 "--simulate", "h100"]) == 0
    assert os.path.exists(os.path.join(out, "simulation.txt")), os.listdir(out)


def test_plan_names_the_ranks_without_a_stage(tmp_path, capsys):
    """examples/pipeline.py places its two stages on ranks 0 and 1: with --nproc 8 the others idle."""
    out = str(tmp_path / "plans")
    assert main(["plan", os.path.join(ROOT, "examples", "pipeline.py"), "--nproc", "8", "--out", out,
                 "--no-chart"]) == 0
    assert "rank(s) 2-7 of --nproc 8 hold no stage" in capsys.readouterr().out


LAYOUTS = os.path.join(HERE, "scripts", "mlp_layouts.py")
MEASURED_LAYOUTS = {"tp2": (["--tp", "2"], 2), "pp2xdp2": (["--pp", "2", "--dp", "2"], 4),
                    "pp2xdp2xtp2": (["--pp", "2", "--dp", "2", "--tp", "2"], 8)}


@pytest.fixture
def fixed_transport(monkeypatch):
    """Transport costs without the two processes measure_transport spawns (not the subject)."""
    from graphc.tools import costs
    from graphc.tools.transport_costs import TransportCosts
    monkeypatch.setattr(costs, "measure_transport", lambda kind, nbytes, threads=1, **_: TransportCosts(
        "shm", 5e-6, 1e-10, 5e-6, 1e-10, 2e-5, []))


@pytest.mark.parametrize("layout", sorted(MEASURED_LAYOUTS))
def test_simulate_measured_on_tensor_and_hybrid_layouts(tmp_path, fixed_transport, layout):
    """`--simulate` (measured costs) times each stage's compute here on one rank's shards, its
    collectives moving nothing (NOTE: Shapes only), and the simulator models communication:
    it crashed on tensor-parallel and pipeline x data plans ("Default process group has not
    been initialized", "rank 0 is in none of the groups ((2, 3),)")."""
    import torch.distributed as dist
    args, n = MEASURED_LAYOUTS[layout]
    out = str(tmp_path / "plans")
    assert main(["plan", LAYOUTS, *args, "--nproc", str(n), "--out", out, "--simulate",
                 "--no-chart"]) == 0
    assert not dist.is_initialized()
    with open(os.path.join(out, "simulation.txt")) as f:
        table = f.read()
    assert "costs measured on this machine" in table
    rows = [line.split() for line in table.splitlines()[2:] if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(n))
    assert all(float(r[2]) > 0 for r in rows), table          # every rank computed
    assert any(isinstance(i, __import__("graphc").plan.instructions.Collective)
               for p in load_plans(out, n) for i in p.instructions) or "tp" not in layout


@pytest.mark.parametrize("script,args", [
    (os.path.join(ROOT, "examples", "gpt.py"), ["--pp", "2", "--dp", "2", "--steps", "1"]),
    (os.path.join(HERE, "scripts", "llama_like.py"), ["--pp", "2", "--dp", "2"])],
    ids=["gpt", "llama_like"])
def test_simulate_measured_transformer_pipeline_by_data(tmp_path, fixed_transport, script, args):
    """The GPT example and a small Llama-like model (GQA, RoPE buffers, RMSNorm) on pipeline
    2 x data 2 with measured costs (the issue's reproductions)."""
    out = str(tmp_path / "plans")
    assert main(["plan", script, "--nproc", "4", "--out", out, "--simulate", "--no-chart", "--",
                 *args]) == 0
    with open(os.path.join(out, "simulation.txt")) as f:
        assert "costs measured on this machine" in f.read()


def test_measured_costs_run_on_one_ranks_shards(monkeypatch, tmp_path):
    """A tensor-parallel stage is timed on its local shards: Megatron's fc1 output is half as
    wide on 2 ranks, so the activations autograd saves shrink (whole parameters would not
    even run against the shards the collectives return)."""
    from graphc.modes import PlanModeExit, plan_mode
    from graphc.tools.costs import measure_costs
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import plan_scale
    saved = {}
    for tp in (1, 2):
        for k, v in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", tp), ("LOCAL_WORLD_SIZE", tp)):
            monkeypatch.setenv(k, str(v))
        graph, inputs = plan_scale.mlp_graph(1, 1, tp, 2, rows_per_mb=4)
        with plan_mode(tp, str(tmp_path / f"tp{tp}"), None, False):
            with pytest.raises(PlanModeExit):
                graph(*inputs)
        costs = measure_costs(graph.compiled, repeats=1)
        saved[tp] = costs.activation_bytes[0]
        whole = {n: tuple(p.shape) for n, p in graph.compiled.programs[0].module.named_parameters()}
        assert whole["model.blocks.0.fc1.weight"] == (128, 32)    # the user's are left whole
    assert saved[2] < saved[1], saved


def test_measured_costs_model_collectives_over_gloo():
    """With a measured transport (sends: no bandwidth term), collectives still cost gloo's
    loopback link: a 4 MB all-reduce over 2 ranks is not free."""
    from graphc.plan.instructions import Collective
    from graphc.tools.costs import CPU_LINK_BANDWIDTH, CPU_LINK_LATENCY_S, CostModel
    from graphc.tools.transport_costs import TransportCosts
    base = CostModel({0: 1.0}, {0: 2.0}, latency=CPU_LINK_LATENCY_S, bandwidth=CPU_LINK_BANDWIDTH,
                     collective_link=(CPU_LINK_BANDWIDTH, CPU_LINK_LATENCY_S))
    costs = TransportCosts("shm", 5e-6, 1e-10, 5e-6, 1e-10, 2e-5, []).apply(base)
    assert costs.bandwidth == float("inf")
    ins = Collective(kind="all_reduce", stage=0, microbatch=0, direction="F", ranks=(0, 1),
                     node="box", sbp_in="partial_sum", sbp_out="broadcast", nbytes=2 << 20)
    assert costs.collective(ins) == pytest.approx(base.collective(ins)) and costs.collective(ins) > 1e-3
