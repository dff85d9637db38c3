"""A rank that raises or dies mid-step takes every other rank down, promptly and loudly.

faulty_train.py trains a 2-stage pipeline and makes one rank fail inside its backward at
step 3 (printing the time it does). Every launch is bounded by a subprocess timeout
(TIMEOUT), and each test asserts that every process exited non-zero within BOUND seconds
of the failure: far below GRAPHC_TIMEOUT (60 s here) except in the stall case, which
only the timeout (5 s there) can end.
"""
import os
import re

import pytest

from launch import HERE, bare_world, torchrun

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

SCRIPT = os.path.join(HERE, "faulty_train.py")
TIMEOUT = 120
BOUND = 15.0  # seconds from the failure to the last exit (includes interpreter teardown)
HEARTBEAT = "3"  # GRAPHC_HEARTBEAT_TIMEOUT for the kill cases


def _names_dead_rank_1(output: str) -> bool:
    """rank 0 names rank 1: through the transport (gloo: connection closed; shared memory:
    its process, unreaped here, is a zombie) or through its closed liveness connection
    (NOTE: Liveness in graphc/runtime/liveness.py)."""
    return bool(re.search(r"RankFailedError: rank 0: a transfer with rank 1 failed mid-step", output)
                or re.search(r"RankFailedError: rank 1 failed: its process \d+ exited", output)
                or "graphc: rank 1 failed: rank 1: its process is gone (noticed by rank 0" in output)


def _report(name, seconds):
    print(f"{name}: last rank exited {seconds:.2f}s after the failure")


def test_raising_rank_under_torchrun_stops_the_world():
    run = torchrun(SCRIPT, ["--fail-rank", "1", "--mode", "raise"], 2, TIMEOUT)
    assert run.returncode != 0, run.output[-3000:]
    took = run.since_failure(run.output)
    _report("torchrun raise", took)
    assert took < BOUND, run.output[-3000:]
    # rank 0 (waiting for rank 1's gradients) learns of the failure through the store
    assert "graphc: rank 1 failed: rank 1: ValueError: injected failure in backward; exiting rank 0" \
        in run.output, run.output[-3000:]


def test_raising_store_host_without_supervisor():
    """Rank 0 hosts the store and fails; rank 1 still hears of it and exits non-zero."""
    exits = bare_world(SCRIPT, ["--fail-rank", "0", "--mode", "raise"], 2, TIMEOUT)
    assert [e.returncode != 0 for e in exits] == [True, True], [e.output[-2000:] for e in exits]
    took = max(e.since_failure(exits[0].output) for e in exits)
    _report("bare raise on rank 0", took)
    assert took < BOUND
    assert "ValueError: injected failure in backward" in exits[0].output
    assert "graphc: rank 0 failed: rank 0: ValueError" in exits[1].output, exits[1].output[-3000:]


def test_killed_rank_without_supervisor():
    """SIGKILL leaves no chance to report: the survivor's transfer fails and names the peer."""
    exits = bare_world(SCRIPT, ["--fail-rank", "1", "--mode", "kill"], 2, TIMEOUT,
                       GRAPHC_HEARTBEAT_TIMEOUT=HEARTBEAT)
    assert exits[1].returncode == -9, exits[1].output[-2000:]
    assert exits[0].returncode == 1, exits[0].output[-3000:]
    took = exits[0].since_failure(exits[1].output)
    _report("bare SIGKILL of rank 1", took)
    assert took < BOUND
    assert _names_dead_rank_1(exits[0].output), exits[0].output[-3000:]


def test_killed_rank_under_torchrun():
    run = torchrun(SCRIPT, ["--fail-rank", "1", "--mode", "kill"], 2, TIMEOUT,
                   GRAPHC_HEARTBEAT_TIMEOUT=HEARTBEAT)
    assert run.returncode != 0
    took = run.since_failure(run.output)
    _report("torchrun SIGKILL of rank 1", took)
    assert took < BOUND
    assert "rank      : 1" in run.output and "SIGKILL" in run.output, run.output[-3000:]


def test_stalled_rank_is_bounded_by_graphc_timeout():
    """A rank that hangs (alive, silent): the survivor gives up after GRAPHC_TIMEOUT, names
    the stalled peer, and its report makes even the stalled rank exit."""
    exits = bare_world(SCRIPT, ["--fail-rank", "1", "--mode", "hang"], 2, TIMEOUT, GRAPHC_TIMEOUT="5")
    assert [e.returncode for e in exits] == [1, 1], [e.output[-2000:] for e in exits]
    took = max(e.since_failure(exits[1].output) for e in exits)
    _report("bare stall of rank 1 (GRAPHC_TIMEOUT=5)", took)
    assert 5 <= took < 5 + BOUND
    # the transport that timed out names the stalled peer (gloo or shared memory wording)
    assert re.search(r"RankFailedError: rank 0\b.*rank 1", exits[0].output), exits[0].output[-3000:]
    assert "graphc: rank 0 failed:" in exits[1].output and "exiting rank 1" in exits[1].output


def test_killed_store_host_on_shared_memory_is_noticed_without_heartbeats():
    """Rank 0 hosts the store and dies: with heartbeats and the timeout far away (100 s),
    the survivor's shared-memory wait notices its peer's process is gone and names it."""
    exits = bare_world(SCRIPT, ["--fail-rank", "0", "--mode", "kill"], 2, TIMEOUT,
                       GRAPHC_HEARTBEAT_TIMEOUT="100", GRAPHC_TIMEOUT="100", GRAPHC_P2P="shm")
    assert exits[0].returncode == -9, exits[0].output[-2000:]
    assert exits[1].returncode != 0, exits[1].output[-3000:]
    took = exits[1].since_failure(exits[0].output)
    _report("bare SIGKILL of rank 0 (store host), shm", took)
    assert took < BOUND
    assert re.search(r"rank 0 failed: its process \d+ exited", exits[1].output), exits[1].output[-3000:]


def test_zombie_peer_and_dead_store_host_stop_the_world_within_3s():
    """Rank 2 kills rank 0 (the store host) and itself, and is left unreaped (a zombie that
    still answers kill(pid, 0)). With heartbeats and the timeout far away (100 s), rank 1,
    waiting on one of them over shared memory, must take it for dead and exit."""
    exits = bare_world(SCRIPT, ["--fail-rank", "2", "--mode", "kill-store-host"], 3, TIMEOUT,
                       reap_last=2, GRAPHC_HEARTBEAT_TIMEOUT="100", GRAPHC_TIMEOUT="100")
    assert [e.returncode for e in exits] == [-9, 1, -9], [e.output[-2000:] for e in exits]
    took = max(exits[0].ended, exits[1].ended) - float(
        re.search(r"injecting kill at ([0-9.]+)", exits[2].output).group(1))
    _report("bare SIGKILL of rank 0 and zombie rank 2, 3 ranks", took)
    assert took < 3.0, exits[1].output[-3000:]
    assert re.search(r"rank [02] failed: its process \d+ exited", exits[1].output), exits[1].output[-3000:]


def test_failure_news_outlives_the_store_host_on_one_host():
    """Rank 2 kills rank 0 (the store host), then raises: its report can reach no store.
    Rank 1 sleeps 30 s between steps, waiting on nobody through a transfer, with heartbeats
    and the timeout at 100 s: only the host's failure page (NOTE: Failure page in shm.py)
    can tell it, and it must be gone within 3 s."""
    exits = bare_world(SCRIPT, ["--fail-rank", "2", "--mode", "raise-after-store-host",
                                "--sleep-rank", "1", "--sleep-seconds", "30"], 3, TIMEOUT,
                       GRAPHC_HEARTBEAT_TIMEOUT="100", GRAPHC_TIMEOUT="100", GRAPHC_P2P="shm")
    assert [e.returncode for e in exits] == [-9, 1, 1], [e.output[-2000:] for e in exits]
    assert "rank 1 sleeping" in exits[1].output, exits[1].output[-3000:]
    took = exits[1].since_failure(exits[2].output)
    _report("bare raise after killing the store host, rank 1 asleep, 3 ranks", took)
    assert took < 3.0, exits[1].output[-3000:]
    assert "graphc: rank 2 failed: rank 2: ValueError: injected failure after the store host died; " \
           "exiting rank 1" in exits[1].output, exits[1].output[-3000:]
