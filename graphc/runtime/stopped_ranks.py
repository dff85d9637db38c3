"""A peer that stopped calling the graph: named, with the rule every rank must follow.

Under data parallel a rank whose data runs out first (a DataLoader without drop_last over
shards of unequal length) leaves its training loop and exits normally, while the others
call the graph once more; their next transfer or collective with it fails ("Connection
closed by peer ... remote worker crashing" from gloo, or a shared-memory peer's exit). A
rank that exits normally marks itself done in the store (runtime/watchdog.py, DONE_KEY),
so a failed transfer can tell such a rank from a crashed one.
"""
from __future__ import annotations

import time
from typing import List, Optional

from ..errors import RankFailedError

# words of a transfer that lost its peer: gloo's "Connection closed by peer", "Timed out",
# "Connection reset"; graphc's own shared-memory and timeout errors are RankFailedErrors
_LOST_PEER = ("closed", "timed out", "timeout", "reset", "broken pipe")
WAIT_SECONDS = 1.0   # for the peer's done mark: its exit may close sockets before the store sees it


def explain_stopped_peers(exc: BaseException, rank: int, world: int, call: int,
                          what: str = "the graph") -> Optional[RankFailedError]:
    """A RankFailedError naming the ranks that exited normally, if exc is a transfer that
    lost them; else None (exc stands as it is)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if world < 2 or not (isinstance(exc, RankFailedError) or
                         (isinstance(exc, RuntimeError) and any(w in text.lower() for w in _LOST_PEER))):
        return None
    done = _done_ranks(rank, world)
    if not done:
        return None
    said = text.split(". This is typically")[0]   # gloo's guess ("a remote worker crashing") is wrong here
    return RankFailedError(
        f"rank {rank}: rank(s) {done} stopped calling {what}: their script ended normally "
        f"before their call {call}, which rank {rank} is making, so the transfer or collective "
        f"they take part in never came (the transport said: {said}). Every rank must call {what} the same "
        "number of times; under data parallel each rank's data must give the same number of "
        "batches. Fix: equal shards and drop_last=True (DataLoader(..., drop_last=True) with "
        "DistributedSampler(dataset, drop_last=True)), or stop every rank after the same number "
        "of steps (the smallest len(loader) over the ranks).")


def _done_ranks(rank: int, world: int) -> List[int]:
    """The other ranks that exited normally, as the store says (waits up to WAIT_SECONDS).

    A rank that raised marks itself done too when its interpreter exits (the watchdog's
    atexit), after reporting its failure: with a failure reported, none stopped normally.
    """
    from .watchdog import DONE_KEY, FAILED_KEY, _watchdog
    dog = _watchdog()
    if dog is None:
        return []
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        try:
            if dog.keys.check([FAILED_KEY]):
                return []
            done = [r for r in range(world) if r != rank and dog.keys.check([DONE_KEY.format(r)])]
        except Exception:   # the store is gone with its host: nothing more to learn
            return []
        if done or time.monotonic() > deadline:
            return done
        time.sleep(0.1)
