"""A shared-memory wait ends as soon as the peer's process is gone (no store, no timeout)."""
import os
import subprocess
import sys
import time
import uuid

import pytest
import torch

from graphc.errors import RankFailedError
from graphc.runtime import shm

pytestmark = pytest.mark.skipif(not shm.supported(), reason="needs x86-64 Linux with /dev/shm")


def _channel(ends: int = 1):
    """One ring, mapped `ends` times (each rank maps it itself and keeps its own count)."""
    path = f"/dev/shm/graphc-test-{uuid.uuid4().hex[:8]}"
    maps = [shm.ShmChannel(path, slots=2, slot_bytes=64, create=True)]
    maps += [shm.ShmChannel(path, slots=2, slot_bytes=64, create=False) for _ in range(ends - 1)]
    os.unlink(path)
    return maps if ends > 1 else maps[0]


def test_recv_from_a_dead_peer_fails_fast_naming_it():
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    transport = shm.ShmTransport(0, {(1, 0): _channel()}, timeout=60.0, pids={1: peer.pid})
    work = transport.irecv(torch.empty(4), peer=1)
    peer.kill()
    peer.wait()
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=rf"rank 1 failed: its process {peer.pid} exited"):
        work.wait()
    assert time.monotonic() - start < 5.0, "a dead peer must be noticed well before GRAPHC_TIMEOUT"


def test_recv_from_a_live_peer_still_times_out():
    transport = shm.ShmTransport(0, {(1, 0): _channel()}, timeout=0.5, pids={1: os.getpid()})
    with pytest.raises(RankFailedError, match="waited 0s for message 0 from rank 1"):
        transport.irecv(torch.empty(4), peer=1).wait()


def test_message_sent_before_the_peer_exits_is_still_delivered():
    send_end, recv_end = _channel(ends=2)
    sender = shm.ShmTransport(1, {(1, 0): send_end}, timeout=5.0)
    sender.isend(torch.arange(4.0), peer=0)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    receiver = shm.ShmTransport(0, {(1, 0): recv_end}, timeout=5.0, pids={1: gone.pid})
    out = torch.empty(4)
    receiver.irecv(out, peer=1).wait()
    assert torch.equal(out, torch.arange(4.0))
