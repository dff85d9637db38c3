"""examples/pipeline.py under torchrun: one machine, and two torchrun agents (--nnodes 2)."""
import os
import re
import subprocess
import sys

import pytest

from helpers import free_port

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "pipeline.py")
TIMEOUT = 180


def _losses(text: str):
    return [float(v) for v in re.findall(r"loss ([0-9.]+)", text)]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", GRAPHC_TIMEOUT="60")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.slow   # CI time: the example runs on two agents below (test_example_two_agents_as_two_machines)
def test_example_single_node_loss_falls():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), EXAMPLE, "--steps", "8"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    losses = _losses(out.stdout)
    assert len(losses) == 8, out.stdout
    assert losses[-1] < losses[0] * 0.95, losses


def test_example_two_agents_as_two_machines():
    """Two torchrun agents with --nnodes 2 on 127.0.0.1, as on two machines."""
    port = str(free_port())
    procs = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank",
               str(node_rank), "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
               "--master_port", port, EXAMPLE, "--steps", "5"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=_env()))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT))
    finally:
        for p in procs:
            p.kill()
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr[-3000:]
    # the loss lives on stage 1, i.e. on the second agent's only worker
    assert _losses(outs[0][0]) == []
    losses = _losses(outs[1][0])
    assert len(losses) == 5 and losses[-1] < losses[0], outs[1][0]
