"""benchmarks/memory_soak.py: 500 steps of a 4-stage pipeline, resident memory flat."""
import os
import re

import pytest

from launch import ROOT, torchrun

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

SOAK = os.path.join(ROOT, "benchmarks", "memory_soak.py")


@pytest.mark.slow
def test_500_step_pipeline_grows_rss_less_than_5_percent():
    run = torchrun(SOAK, ["--steps", "500", "--warmup", "50", "--limit", "5"], 4, timeout=900)
    growths = [float(g) for g in re.findall(r"rank \d+ rss .* growth ([+-][0-9.]+)%", run.output)]
    assert len(growths) == 4, run.output[-3000:]
    assert max(growths) < 5.0, run.output[-3000:]
    assert run.returncode == 0, run.output[-3000:]
