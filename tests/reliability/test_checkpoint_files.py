"""graphc.save / graphc.load: a crash while saving keeps the last good checkpoint."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import graphc
from graphc import GraphcError
from launch import env

OLD = {"w": torch.arange(10.0), "steps": 3}


def test_round_trip(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    graphc.save(OLD, path)
    got = graphc.load(path)
    assert got["steps"] == 3 and torch.equal(got["w"], OLD["w"])
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temporary file left behind


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    graphc.save(OLD, path)

    def torn_save(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="disk full"):
        graphc.save({"w": torch.zeros(10), "steps": 4}, path)
    monkeypatch.undo()
    got = graphc.load(path)
    assert got["steps"] == 3 and torch.equal(got["w"], OLD["w"])
    assert os.listdir(tmp_path) == ["ckpt.pt"]


_WRITER = """
import sys, torch, graphc
big = {"w": torch.ones(64, 2 ** 20), "steps": 4}   # 256 MiB: the kill lands mid-write
print("saving", flush=True)
while True:
    graphc.save(big, sys.argv[1])
"""


def test_killed_writer_keeps_a_complete_file(tmp_path):
    """SIGKILL a process in the middle of saving: the file is the old or the new one, whole."""
    path = str(tmp_path / "ckpt.pt")
    graphc.save(OLD, path)
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, path], stdout=subprocess.PIPE,
                            text=True, env=env())
    try:
        assert proc.stdout.readline().strip() == "saving"
        time.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    got = graphc.load(path)
    assert got["steps"] in (3, 4)
    if got["steps"] == 3:
        assert torch.equal(got["w"], OLD["w"])
    else:
        assert got["w"].shape == (64, 2 ** 20) and bool((got["w"] == 1).all())


def test_next_save_removes_what_a_killed_save_left(tmp_path):
    """A save killed mid-write leaves <path>.<pid>.<random>.tmp; the next save to the path
    deletes it (and an older graphc's <path>.<random>.tmp), but keeps a live writer's file
    and other paths' temporaries."""
    path = str(tmp_path / "ckpt.pt")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [f"ckpt.pt.{dead.pid}.abcd1234.tmp", "ckpt.pt.old_1234.tmp"]
    kept = [f"ckpt.pt.{os.getppid()}.live5678.tmp", f"ckpt.pt.bak.{dead.pid}.abcd1234.tmp",
            "other.pt.abcd1234.tmp"]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"half a checkpoint")
    graphc.save(OLD, path)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt.pt"] + kept)
    assert graphc.load(path)["steps"] == 3


def test_loading_a_torn_file_is_a_clear_error(tmp_path):
    path = str(tmp_path / "torn.pt")
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04 not really a checkpoint")
    with pytest.raises(GraphcError, match="is not a readable checkpoint"):
        graphc.load(path)


def test_loading_a_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(GraphcError, match="no checkpoint at"):
        graphc.load(str(tmp_path / "nope.pt"))
