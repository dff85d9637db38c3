"""Failure propagation: a rank that fails mid-step takes the whole world down, promptly.

NOTE: Failure propagation
  - A rank whose step raises writes FAILED_KEY = "rank R: <error>" into the default
    torch.distributed store (the c10d TCPStore every rank already shares), waits a
    moment for the others to acknowledge (so the store, hosted by rank 0, outlives the
    message), then re-raises.
  - Every rank runs a daemon thread (started by its first step) that polls the store. On
    seeing another rank's failure it prints "graphc: rank R failed: ...; exiting rank r"
    to stderr and exits the process non-zero (os._exit: the main thread may be blocked
    in a collective that will never complete).
  - A rank that dies without raising (SIGKILL, OOM kill) cannot write the key. Its
    watchdog also beats a heartbeat counter in the store (BEAT_KEY, once a second), and
    reads its ring successor's (See NOTE: Watchdog cost); a successor whose counter stops
    for GRAPHC_HEARTBEAT_TIMEOUT seconds (default 10) without having marked itself done
    (DONE_KEY, at a normal exit) is declared dead: the rank that notices writes FAILED_KEY
    for it and exits as above. A gloo transfer from a dead peer usually
    fails sooner ("connection closed"), which run_step turns into a RankFailedError naming
    that peer; the shared-memory transport sees no connection, so there the heartbeat is
    what notices. Everything else is bounded by GRAPHC_TIMEOUT, the transfer timeout
    (see dist_env.timeout_seconds).
  - A lost connection to the store is not taken as a failure: rank 0 legitimately exits
    first at the end of a run. The watchdog then goes on polling the host's failure page
    (See NOTE: Failure page in shm.py), which every failure message is written to first,
    so ranks on rank 0's host still hear of a failure reported after the store is gone.

NOTE: Watchdog cost
The store is one process (rank 0's TCPStore), so the watchdogs' requests must grow with
the world, not its square. Each rank, per second: 10 checks of FAILED_KEY (the 0.1 s
poll that bounds how fast failure news spreads), 1 beat of its own counter, and 1 read
of its ring successor's (rank r watches r + 1 mod world) - 12 requests, 12 * world in
total. Every rank is watched by exactly one other; when the watched rank is done, its
watcher moves on to the next rank, so a normal exit leaves no rank unwatched. A dead rank
is noticed by its predecessor alone, within GRAPHC_HEARTBEAT_TIMEOUT + 1 s as before,
and that one FAILED_KEY write reaches everyone through their polls.
tests/runtime/test_watchdog_cost.py counts the requests at 8, 64 and 256 ranks.
"""
from __future__ import annotations

import atexit
import os
import re
import sys
import threading
import time
import uuid
from typing import Callable, Optional

import torch.distributed as dist

from ..env import seconds_from_env
from ..errors import GraphcError, RankFailedError
from . import host, shm

# Keys live under graphc/<torchrun restart count>/, so a restarted world (torchrun
# --max-restarts, whose store may outlive a round) never reads the last round's failure.
FAILED_KEY = "failed"
ACK_KEY = "failed_acks"
PAGE_KEY = "failure_page"
BEAT_KEY = "beat/{}"
DONE_KEY = "done/{}"
POLL_SECONDS = 0.1
BEAT_SECONDS = 1.0
ACK_WAIT_SECONDS = 3.0

_PEER_RE = re.compile(r"rank (\d+)")


class Watchdog:
    """Polls the store for another rank's failure, beats this rank's heartbeat, and watches
    its ring successor's (See NOTE: Watchdog cost)."""

    def __init__(self, store, rank: int, world_size: int, keys, start: bool = True, page=None):
        self.rank, self.world_size = rank, world_size
        self.store, self.keys, self.page = store, keys, page
        self.store_gone = False
        self.heartbeat_timeout = heartbeat_timeout_seconds()
        self._stopped = False
        self._next_beat = 0.0
        self.watched = self._successor(rank)  # None once every other rank is done
        self._seen = (-1, 0.0)  # watched peer's last counter value, time it changed
        self._thread = threading.Thread(target=self._loop, name="graphc-watchdog", daemon=True)
        if start:
            self._thread.start()

    def _loop(self) -> None:
        while not self._stopped:
            try:
                message = self.tick(time.monotonic())
            except Exception:  # store gone: see NOTE; the page alone may still tell
                self.store_gone = True
                if self.page is None:
                    return
                message = None
            if message:
                self._exit_for(message)
            time.sleep(POLL_SECONDS)

    def tick(self, now: float) -> Optional[str]:
        """One poll: the failure this rank must exit for, if any. Raises if the store is gone."""
        message = self.page.read() if self.page is not None else None
        if message and not message.startswith(f"rank {self.rank}:"):
            return message
        if self.store_gone:
            return None
        if self.keys.check([FAILED_KEY]):
            message = self.keys.get(FAILED_KEY).decode()
            if not message.startswith(f"rank {self.rank}:"):
                return message
        if now < self._next_beat:
            return None
        self._next_beat = now + BEAT_SECONDS
        self.keys.add(BEAT_KEY.format(self.rank), 1)
        dead = self._silent_successor(now)
        return None if dead is None else self._declare_dead(dead)

    def _silent_successor(self, now: float) -> Optional[int]:
        """The watched peer if it has beaten before but not for heartbeat_timeout seconds and
        is not done; a done peer hands the watch on to its own successor."""
        while self.watched is not None:
            count = self.keys.add(BEAT_KEY.format(self.watched), 0)
            if count != self._seen[0]:
                self._seen = (count, now)
                return None
            if now - self._seen[1] <= self.heartbeat_timeout:
                return None
            if not self.keys.check([DONE_KEY.format(self.watched)]):
                return self.watched if count > 0 else None  # one that never beat may be slow to start
            self.watched, self._seen = self._successor(self.watched), (-1, now)
        return None

    def _successor(self, peer: int) -> Optional[int]:
        nxt = (peer + 1) % self.world_size
        return None if nxt == self.rank else nxt

    def _declare_dead(self, peer: int) -> str:
        message = (f"rank {peer}: no heartbeat for {self.heartbeat_timeout:.0f}s (noticed by rank "
                   f"{self.rank}); the process died, was killed, or is frozen")
        self._to_page(message)
        try:
            self.keys.set(FAILED_KEY, message)
        except Exception:
            pass
        return message

    def stop(self) -> None:
        """Ends the polling thread (before interpreter shutdown: a daemon thread caught inside
        a store call while Python finalizes aborts the process)."""
        self._stopped = True
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * POLL_SECONDS + 1)

    def mark_done(self) -> None:
        """A normal exit: peers must not mistake the silence that follows for a death."""
        try:
            self.keys.set(DONE_KEY.format(self.rank), "1")
        except Exception:
            pass

    def _exit_for(self, message: str) -> None:
        sys.stderr.write(f"graphc: {_failed_rank_text(message)} failed: {message}; "
                         f"exiting rank {self.rank}\n")
        sys.stderr.flush()
        self._to_page(message)  # relays news from the store to this host's ranks
        try:
            if not self.store_gone:
                self.keys.add(ACK_KEY, 1)
        except Exception:
            pass
        self.close_page()
        os._exit(1)

    def _to_page(self, message: str) -> None:
        if self.page is not None:
            try:
                self.page.write(message)
            except Exception:
                pass

    def close_page(self) -> None:
        if self.page is not None:
            try:
                self.page.close()
            except Exception:
                pass

    def report(self, exc: BaseException) -> None:
        """Tells the other ranks this rank failed, and gives them time to read it."""
        text = f"rank {self.rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        dead = re.search(r"rank (\d+) failed", text)  # a peer known dead will never acknowledge
        expected = self.world_size - 1 - (dead is not None and int(dead.group(1)) != self.rank)
        self._to_page(text)  # first: the store may already be gone with rank 0
        try:
            self.keys.set(FAILED_KEY, text)
            deadline = time.monotonic() + ACK_WAIT_SECONDS
            while time.monotonic() < deadline and self.keys.add(ACK_KEY, 0) < expected:
                time.sleep(POLL_SECONDS / 2)
        except Exception:
            pass


def heartbeat_timeout_seconds() -> float:
    """GRAPHC_HEARTBEAT_TIMEOUT (seconds, default 10): silence after which a rank is dead."""
    return seconds_from_env("GRAPHC_HEARTBEAT_TIMEOUT", 10)


def _failed_rank_text(message: str) -> str:
    m = _PEER_RE.match(message)
    return f"rank {m.group(1)}" if m else "another rank"


_WATCHDOG: Optional[Watchdog] = None


def _watchdog() -> Optional[Watchdog]:
    """The process's watchdog, started on the first step of a multi-rank world."""
    global _WATCHDOG
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    store = dist.distributed_c10d._get_default_store()
    if _WATCHDOG is not None and _WATCHDOG.store is not store:  # a new process group
        _WATCHDOG.stop()
        _WATCHDOG.close_page()
        _WATCHDOG = None
    if _WATCHDOG is None:
        keys = dist.PrefixStore(f"graphc/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
        _WATCHDOG = Watchdog(store, dist.get_rank(), dist.get_world_size(), keys,
                             page=_open_page(keys))
    return _WATCHDOG


def _open_page(keys) -> Optional["shm.FailurePage"]:
    """This host's failure page for this job (See NOTE: Failure page in shm.py), or None."""
    if not shm.supported():
        return None
    try:
        job = keys.compare_set(PAGE_KEY, "", uuid.uuid4().hex).decode()
        sharers = host.SHARED_RANKS or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return shm.FailurePage(shm.PAGE_PREFIX + job, sharers)
    except Exception:
        return None


@atexit.register
def _stop_at_exit() -> None:
    if _WATCHDOG is not None:
        _WATCHDOG.mark_done()
        _WATCHDOG.stop()
        _WATCHDOG.close_page()


def run_step(step: Callable, *args):
    """Runs one runtime step under the watchdog; a failure here is announced to every rank."""
    dog = _watchdog()
    if dog is None:
        return step(*args)
    try:
        return step(*args)
    except BaseException as exc:
        error = _as_rank_error(exc, dog.rank)
        dog.report(error)
        if error is exc:
            raise
        raise error from exc


def _as_rank_error(exc: BaseException, rank: int) -> BaseException:
    """A transport error from a dead peer becomes a RankFailedError naming that peer."""
    if isinstance(exc, GraphcError) or not isinstance(exc, RuntimeError):
        return exc
    peer = getattr(exc, "graphc_peer", None)
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if peer is None and "timed out" not in text.lower() and "closed" not in text.lower():
        return exc
    who = f"rank {peer}" if peer is not None else "a peer rank"
    return RankFailedError(
        f"rank {rank}: a transfer with {who} failed mid-step ({text}). Expected: {who} alive "
        f"and answering within GRAPHC_TIMEOUT; found: it died, failed or stalled. Fix: look at "
        f"{who}'s own error output above; raise GRAPHC_TIMEOUT if a step legitimately takes longer.")
