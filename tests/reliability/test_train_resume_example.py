"""examples/train_resume.py under torchrun --max-restarts 1: a rank dies, the job resumes
from the last checkpoint and ends with exactly the parameters of an unbroken run."""
import os

import pytest
import torch

import graphc
from launch import ROOT, torchrun

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

EXAMPLE = os.path.join(ROOT, "examples", "train_resume.py")
TIMEOUT = 300
ARGS = ["--steps", "10", "--save-every", "4"]


def test_crash_and_automatic_resume_match_an_unbroken_run(tmp_path):
    clean = torchrun(EXAMPLE, ARGS + ["--ckpt-dir", str(tmp_path / "a"), "--out", str(tmp_path / "a.pt")],
                     2, TIMEOUT)
    assert clean.returncode == 0, clean.output[-3000:]
    crashed = torchrun(EXAMPLE, ARGS + ["--ckpt-dir", str(tmp_path / "b"), "--out", str(tmp_path / "b.pt"),
                                        "--crash-at-step", "6"], 2, TIMEOUT, ["--max-restarts", "1"])
    assert crashed.returncode == 0, crashed.output[-3000:]
    assert "rank 1: crashing in step 6" in crashed.output
    assert "rank 0: resumed from step 4" in crashed.output and "rank 1: resumed from step 4" in crashed.output
    ref, got = graphc.load(str(tmp_path / "a.pt")), graphc.load(str(tmp_path / "b.pt"))
    assert ref.keys() == got.keys() and len(ref) == 6
    for k in ref:
        assert torch.equal(ref[k], got[k]), f"{k} differs between the unbroken and the resumed run"
    assert sorted(os.listdir(tmp_path / "b")) == ["crashed", "latest", "step4", "step8"]
