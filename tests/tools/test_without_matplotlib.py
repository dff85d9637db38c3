"""Installed without the `plan` extra: graphc trains, and `graphc plan` says what to install.

The checks run in a fresh interpreter where `import matplotlib` fails
(sys.modules["matplotlib"] = None before graphc is imported), as on a training node
installed with `pip install graphc`: one interpreter for all of them (RUNNER).
"""
import os
import re
import subprocess
import sys
from textwrap import dedent

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
# One fresh interpreter runs every check, each part's output after its `== part ==` line (a
# failing part prints its traceback there and the others still run): starting an interpreter
# that imports torch costs more than the three checks.
RUNNER = """
import contextlib, io, sys, traceback
sys.modules["matplotlib"] = None
for name, code in PARTS:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            exec(code, {"__name__": "__main__", "sys": sys})
        except BaseException:
            traceback.print_exc()
    print(f"== {name} ==\\n{out.getvalue()}", flush=True)
"""

TRAIN = """
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
"""

PLAN = """
    from graphc.cli import main
    print("exit code", main(["plan", SCRIPT, "--nproc", "2", "--out", OUT]))
"""

CHART = """
    from graphc import GraphcError
    from graphc.tools.chart import draw_timeline
    try:
        draw_timeline({0: []}, "chart", "title")
    except GraphcError as e:
        print("error:", e)
"""


@pytest.fixture(scope="module")
def without_matplotlib(tmp_path_factory):
    """(each part's output by name, the plans folder, the interpreter's stderr)."""
    tmp_path = tmp_path_factory.mktemp("without_matplotlib")
    out, script = str(tmp_path / "plans"), tmp_path / "two_graphs.py"
    script.write_text(TWO_GRAPHS)
    parts = [("train", dedent(TRAIN)), ("plan", f"SCRIPT, OUT = {str(script)!r}, {out!r}" + dedent(PLAN)),
             ("chart", dedent(CHART))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GRAPHC_DEBUG"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-c", f"PARTS = {parts!r}\n" + RUNNER], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    said = dict(re.findall(r"^== (\w+) ==\n(.*?)(?=^== \w+ ==$|\Z)", r.stdout, re.S | re.M))
    return said, out, r.stderr


def test_one_process_graph_trains_without_matplotlib(without_matplotlib):
    said, _, stderr = without_matplotlib
    assert "trained" in said["train"], said["train"] + stderr


def test_plan_without_matplotlib_writes_plans_and_says_what_to_install(without_matplotlib):
    said, out, stderr = without_matplotlib
    assert "exit code 0" in said["plan"], said["plan"] + stderr
    hint = [line for line in said["plan"].splitlines() if "graphc[plan]" in line]
    assert len(hint) == 1, said["plan"]           # once, though two graphs compiled
    assert "matplotlib" in hint[0] and "pip install" in hint[0]
    assert os.path.getsize(os.path.join(out, "rank1.json")) > 0
    assert not os.path.exists(os.path.join(out, "schedule.png"))


def test_chart_without_matplotlib_is_a_graphc_error(without_matplotlib):
    said, _, stderr = without_matplotlib
    assert 'error: graphc\'s schedule charts need matplotlib' in said["chart"], said["chart"] + stderr
    assert 'pip install "graphc[plan]"' in said["chart"]


@pytest.mark.parametrize("extra", ["plan", "test"])
def test_setup_cfg_extras_carry_matplotlib(extra):
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    assert "matplotlib" not in cfg["options"]["install_requires"]
    assert "matplotlib" in cfg["options.extras_require"][extra]
