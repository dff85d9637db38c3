"""Two ranks that look alike but do not share /dev/shm talk over gloo, and train as one host would.

Rank 1 runs in a private mount namespace with its own tmpfs on /dev/shm (`unshare -m`):
same hostname, machine-id and boot-id as rank 0, so only the probe of NOTE: Same host
(graphc/runtime/host.py) can tell. Float64 numbers are bit-identical over either transport.
"""
import os
import shutil
import subprocess
import tempfile

import pytest
import torch

from graphc.runtime import host
from launch import HERE, bare_world

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

SCRIPT = os.path.join(HERE, "two_hosts_train.py")
PRIVATE_SHM = ["unshare", "-m", "--propagation", "private", "sh", "-c",
               'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" "$@"']


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run([*PRIVATE_SHM, "true"], capture_output=True).returncode == 0


def _train(wrap=None):
    with tempfile.TemporaryDirectory() as out:
        exits = bare_world(SCRIPT, [out], 2, 180, wrap=wrap)
        assert [e.returncode for e in exits] == [0, 0], [e.output[-3000:] for e in exits]
        return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in (0, 1)]


@pytest.mark.skipif(not _can_unshare(), reason="needs unshare -m and mount (root or user namespaces)")
def test_same_hostname_but_separate_shm_falls_back_to_gloo_and_trains():
    split = _train(wrap={1: PRIVATE_SHM})
    one_host = _train()
    assert host.host_identity()  # the same identity on both ranks: only the probe tells them apart
    for rank in (0, 1):
        assert set(split[rank]["kinds"].values()) == {"gloo"}, split[rank]["kinds"]
        assert set(one_host[rank]["kinds"].values()) == {"shm"}, one_host[rank]["kinds"]
        assert all(torch.equal(a, b) for a, b in zip(split[rank]["losses"], one_host[rank]["losses"]))
        for key, value in one_host[rank]["state"].items():
            assert torch.equal(split[rank]["state"][key], value), key
