"""Installed without the `plan` extra: graphc trains, and `graphc plan` says what to install.

Each check runs in a fresh interpreter where `import matplotlib` fails
(sys.modules["matplotlib"] = None before graphc is imported), as on a training node
installed with `pip install graphc`.
"""
import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TWO_GRAPHS = """
import torch
from models import PipelineGraph, SkipNet
model = SkipNet(2)
x, y = torch.randn(16, 16), torch.randint(0, 5, (16,))
PipelineGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), None, 4, "1f1b", "cpu").compile(x, y)
PipelineGraph(model, None, None, 2, "gpipe", "cpu").compile(x, y)
"""
NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None\n"


def run_without_matplotlib(code, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GRAPHC_DEBUG"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-c", NO_MATPLOTLIB + textwrap.dedent(code)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_one_process_graph_trains_without_matplotlib(tmp_path):
    r = run_without_matplotlib("""
        import torch, torch.nn as nn
        import graphc

        class TrainGraph(graphc.Graph):
            def __init__(self, model, opt):
                super().__init__()
                self.model = model
                self.add_optimizer(opt)

            def build(self, x, y):
                loss = nn.functional.mse_loss(self.model(x), y)
                loss.backward()
                return loss

        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        graph = TrainGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        losses = [graph(x, y).to_local().item() for _ in range(3)]
        assert losses[2] < losses[0], losses
        assert sys.modules["matplotlib"] is None
        print("trained", losses)
    """, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "trained" in r.stdout


def test_plan_without_matplotlib_writes_plans_and_says_what_to_install(tmp_path):
    out, script = str(tmp_path / "plans"), tmp_path / "two_graphs.py"
    script.write_text(TWO_GRAPHS)
    r = run_without_matplotlib(f"""
        from graphc.cli import main
        sys.exit(main(["plan", {str(script)!r}, "--nproc", "2", "--out", {out!r}]))
    """, tmp_path)
    assert r.returncode == 0, r.stderr
    said = [line for line in (r.stdout + r.stderr).splitlines() if "graphc[plan]" in line]
    assert len(said) == 1, r.stdout + r.stderr           # once, though two graphs compiled
    assert "matplotlib" in said[0] and "pip install" in said[0]
    assert os.path.getsize(os.path.join(out, "rank1.json")) > 0
    assert not os.path.exists(os.path.join(out, "schedule.png"))


def test_chart_without_matplotlib_is_a_graphc_error(tmp_path):
    r = run_without_matplotlib("""
        from graphc import GraphcError
        from graphc.tools.chart import draw_timeline
        try:
            draw_timeline({0: []}, "chart", "title")
        except GraphcError as e:
            print("error:", e)
    """, tmp_path)
    assert r.returncode == 0, r.stderr
    assert 'error: graphc\'s schedule charts need matplotlib' in r.stdout
    assert 'pip install "graphc[plan]"' in r.stdout


@pytest.mark.parametrize("extra", ["plan", "test"])
def test_setup_cfg_extras_carry_matplotlib(extra):
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    assert "matplotlib" not in cfg["options"]["install_requires"]
    assert "matplotlib" in cfg["options.extras_require"][extra]
