"""graphc.save / graphc.load: a crash while saving keeps the last good checkpoint."""
import errno
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

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


class _FailingFile:
    """The file graphc.save writes through, failing with `errno` once `after` bytes are in
    (what a full disk does to a write mid-checkpoint)."""

    def __init__(self, f, errno_, after=1000):
        self.f, self.errno, self.left = f, errno_, after

    def write(self, data):
        self.left -= len(data)
        if self.left < 0:
            raise OSError(self.errno, os.strerror(self.errno))
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def _failing_writes(monkeypatch, errno_):
    real = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: _FailingFile(real(fd, *a, **k), errno_))


BIG = {"w": torch.randn(64, 64), "steps": 4}  # bigger than the bytes _FailingFile lets through


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    graphc.save(OLD, path)
    _failing_writes(monkeypatch, errno.EIO)
    with pytest.raises(Exception) as raised:
        graphc.save(BIG, path)
    assert not isinstance(raised.value, GraphcError), raised.value  # not a disk-full message
    monkeypatch.undo()
    got = graphc.load(path)
    assert got["steps"] == 3 and torch.equal(got["w"], OLD["w"])
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_disk_full_is_named_with_the_path_and_keeps_the_old_file(tmp_path, monkeypatch):
    """A write failing with ENOSPC mid-save (torch's own writer turns it into a RuntimeError
    that says only 'file write failed') is a GraphcError saying so, with the path."""
    path = str(tmp_path / "ckpt.pt")
    graphc.save(OLD, path)
    _failing_writes(monkeypatch, errno.ENOSPC)
    with pytest.raises(GraphcError, match="no space left on device") as raised:
        graphc.save(BIG, path)
    assert repr(path) in str(raised.value) and "is intact" in str(raised.value)
    monkeypatch.undo()
    assert graphc.load(path)["steps"] == 3
    assert os.listdir(tmp_path) == ["ckpt.pt"]


def test_a_flipped_bit_is_refused_naming_the_file(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    graphc.save({"w": torch.arange(1000.0), "steps": 3}, path)
    data = bytearray(open(path, "rb").read())
    assert data.startswith(b"graphc-checkpoint sha256:")
    data[len(data) // 2] ^= 0x01  # inside the tensor's bytes: torch.load alone reads it silently
    open(path, "wb").write(bytes(data))
    with pytest.raises(GraphcError, match="is corrupt: its checksum") as raised:
        graphc.load(path)
    assert repr(path) in str(raised.value)


def test_a_file_without_checksum_from_older_graphc_still_loads(tmp_path):
    path = str(tmp_path / "old.pt")
    torch.save(OLD, path)  # what graphc.save wrote before checksums
    got = graphc.load(path)
    assert got["steps"] == 3 and torch.equal(got["w"], OLD["w"])


class _NumpyLr(graphc.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model
        opt = torch.optim.SGD(model.parameters(), lr=np.float64(0.1), momentum=0.9)
        self.add_optimizer(opt, lr_sch=torch.optim.lr_scheduler.StepLR(opt, 1, gamma=np.float64(0.5)))

    def build(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def test_numpy_learning_rates_are_saved_loadably_and_resume_exactly(tmp_path):
    """A numpy.float64 lr (param groups) and gamma (LR scheduler state): the file loads, and
    resuming from it ends where the unbroken run ends, bit for bit."""
    batches = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(4)]
    torch.manual_seed(0)
    unbroken = _NumpyLr(torch.nn.Linear(3, 2))
    for x, y in batches:
        unbroken(x, y)
    torch.manual_seed(0)
    first = _NumpyLr(torch.nn.Linear(3, 2))
    for x, y in batches[:2]:
        first(x, y)
    sd = first.state_dict()
    assert isinstance(sd["optim"]["param_groups"][0]["lr"], np.floating)  # what made files unloadable
    path = str(tmp_path / "ckpt.pt")
    graphc.save(sd, path)
    loaded = graphc.load(path)
    assert type(loaded["optim"]["param_groups"][0]["lr"]) is float
    assert loaded["optim"]["param_groups"][0]["lr"] == float(sd["optim"]["param_groups"][0]["lr"])
    torch.manual_seed(1)
    resumed = _NumpyLr(torch.nn.Linear(3, 2))
    resumed.load_state_dict(loaded)
    for x, y in batches[2:]:
        resumed(x, y)
    for k, v in unbroken.full_state_dict().items():
        assert torch.equal(resumed.full_state_dict()[k], v), k


def test_a_value_that_would_not_load_is_refused_at_save_naming_where(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    graphc.save(OLD, path)
    with pytest.raises(GraphcError, match=r"obj\['extra'\]\['table'\] is a numpy.ndarray") as raised:
        graphc.save({**OLD, "extra": {"table": np.zeros(3)}}, path)
    assert "nothing was written" in str(raised.value)
    assert graphc.load(path)["steps"] == 3  # the previous file is untouched


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
