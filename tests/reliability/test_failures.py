"""A rank that raises or dies mid-step takes every other rank down, promptly and loudly.

faulty_train.py trains a 2-stage pipeline and makes one rank fail inside its backward at
step 3. Every test bounds the whole run with a subprocess timeout (TIMEOUT) and asserts
it ended well inside it: the failure is reported and every process exits non-zero,
long before GRAPHC_TIMEOUT (60 s here) could have fired.
"""
import os

from launch import HERE, bare_world, torchrun

SCRIPT = os.path.join(HERE, "faulty_train.py")
TIMEOUT = 120
PROMPT = 45  # seconds: start-up and compile of two processes on a small CI box, plus the failure


def test_raising_rank_under_torchrun_stops_the_world():
    run = torchrun(SCRIPT, ["--fail-rank", "1", "--mode", "raise"], 2, TIMEOUT)
    assert run.returncode != 0, run.output[-3000:]
    assert run.seconds < PROMPT, f"took {run.seconds:.1f}s\n{run.output[-3000:]}"
    # rank 0 (waiting for rank 1's gradients) learns of the failure through the store
    assert "graphc: rank 1 failed: rank 1: ValueError: injected failure in backward; exiting rank 0" \
        in run.output, run.output[-3000:]


def test_raising_store_host_without_supervisor():
    """Rank 0 hosts the store and fails; rank 1 still hears of it and exits non-zero."""
    exits = bare_world(SCRIPT, ["--fail-rank", "0", "--mode", "raise"], 2, TIMEOUT)
    assert [e.returncode != 0 for e in exits] == [True, True], [e.output[-2000:] for e in exits]
    assert max(e.seconds for e in exits) < PROMPT, [e.seconds for e in exits]
    assert "ValueError: injected failure in backward" in exits[0].output
    assert "graphc: rank 0 failed: rank 0: ValueError" in exits[1].output, exits[1].output[-3000:]


def test_killed_rank_without_supervisor():
    """SIGKILL leaves no chance to report: the survivor's transfer fails and names the peer."""
    exits = bare_world(SCRIPT, ["--fail-rank", "1", "--mode", "kill"], 2, TIMEOUT)
    assert exits[1].returncode == -9, exits[1].output[-2000:]
    assert exits[0].returncode != 0, exits[0].output[-3000:]
    assert max(e.seconds for e in exits) < PROMPT, [e.seconds for e in exits]
    assert "RankFailedError: rank 0: a transfer with rank 1 failed mid-step" in exits[0].output, \
        exits[0].output[-3000:]


def test_killed_rank_under_torchrun():
    run = torchrun(SCRIPT, ["--fail-rank", "1", "--mode", "kill"], 2, TIMEOUT)
    assert run.returncode != 0
    assert run.seconds < PROMPT, f"took {run.seconds:.1f}s"
    assert "rank      : 1" in run.output and "SIGKILL" in run.output, run.output[-3000:]


def test_stalled_rank_is_bounded_by_graphc_timeout():
    """A rank that hangs (alive, silent): the survivor gives up after GRAPHC_TIMEOUT, names
    the stalled peer, and its report makes even the stalled rank exit."""
    exits = bare_world(SCRIPT, ["--fail-rank", "1", "--mode", "hang"], 2, TIMEOUT, GRAPHC_TIMEOUT="5")
    assert [e.returncode for e in exits] == [1, 1], [e.output[-2000:] for e in exits]
    assert max(e.seconds for e in exits) < PROMPT, [e.seconds for e in exits]
    assert "RankFailedError: rank 0: a transfer with rank 1 failed mid-step" in exits[0].output
    assert "Timed out" in exits[0].output, exits[0].output[-3000:]
    assert "graphc: rank 0 failed:" in exits[1].output and "exiting rank 1" in exits[1].output
