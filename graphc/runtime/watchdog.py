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
    ring predecessor notices within a second (NOTE: Liveness) and writes the key for it
    (See NOTE: Watchdog cost).

NOTE: Watchdog cost
The store is one process (rank 0's TCPStore), so the watchdogs' requests must grow with
the world, not its square. Each rank, per second: 10 checks of FAILED_KEY (the 0.1 s
poll that bounds how fast failure news spreads), and until it has connected to the rank
it watches, 1 check of that rank's liveness address - at most 11 requests, 11 * world in
total; its liveness checks are socket peeks, no store request. Every rank is watched by
exactly one other, its ring predecessor (rank r watches r + 1 mod world); when the
watched rank is done, its watcher moves on to the next rank, so a normal exit leaves no
rank unwatched. A dead rank is noticed by its predecessor alone, within a second, and
that one FAILED_KEY write reaches everyone through their polls.
tests/runtime/test_watchdog_cost.py counts the requests at 8, 64 and 256 ranks.
"""
from __future__ import annotations

import atexit
import os
import re
import sys
import threading
import time
from typing import Callable, Optional

import torch.distributed as dist

from .. import world
from ..env import seconds_from_env
from ..errors import GraphcError, RankFailedError
from . import host, liveness, shm

# Keys live under graphc/<torchrun restart count>/, so a restarted world (torchrun
# --max-restarts, whose store may outlive a round) never reads the last round's failure.
FAILED_KEY = "failed"
ACK_KEY = "failed_acks"
PAGE_KEY = "failure_page"
ALIVE_KEY = "alive/{}"  # a rank's liveness address (See NOTE: Liveness in liveness.py)
DONE_KEY = "done/{}"
POLL_SECONDS = 0.1
LIVENESS_SECONDS = 1.0  # how often the watched rank's liveness is checked
ACK_WAIT_SECONDS = 3.0

_PEER_RE = re.compile(r"rank (\d+)")
_REPORT_RE = re.compile(r"rank (\d+): ")  # how every failure report graphc writes starts


class Watchdog:
    """Polls the store for another rank's failure, and watches its ring successor's process
    (See NOTE: Watchdog cost, NOTE: Liveness)."""

    def __init__(self, store, rank: int, world_size: int, keys, start: bool = True, page=None):
        self.rank, self.world_size = rank, world_size
        self.store, self.keys, self.page = store, keys, page
        self.store_gone = False
        self.heartbeat_timeout = heartbeat_timeout_seconds()
        self._stopped = False
        self._next_check = 0.0
        self.listener = self._listen()
        self.watched = self._successor(rank)  # None once every other rank is done
        self._probe: Optional[liveness.Probe] = None  # of the watched rank
        self._ignored = set()  # forged store values already reported
        self._thread = threading.Thread(target=self._loop, name="graphc-watchdog", daemon=True)
        if start:
            self._thread.start()

    def _listen(self) -> Optional["liveness.Listener"]:
        """Opens and publishes this rank's liveness port; without one, its watcher can never
        declare it dead, and transfers and GRAPHC_TIMEOUT still stop the world."""
        try:
            listener = liveness.Listener(self.world_size)
        except OSError as e:
            _warn(f"graphc: rank {self.rank} has no liveness port ({e}); a death of this rank is "
                  "noticed by the transfers and GRAPHC_TIMEOUT only")
            return None
        try:
            self.keys.set(ALIVE_KEY.format(self.rank), listener.address)
        except Exception:
            pass
        return listener

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
            message = self._report_read(self.keys.get(FAILED_KEY))
            if message and not message.startswith(f"rank {self.rank}:"):
                return message
        if now < self._next_check:
            return None
        self._next_check = now + LIVENESS_SECONDS
        dead = self._dead_successor()
        return None if dead is None else self._declare_dead(dead)

    def _report_read(self, raw: bytes) -> Optional[str]:
        """A failure report from the store, or None for a value graphc never writes (any
        store client can write one: it is reported once and ignored, not obeyed)."""
        message = raw.decode("utf-8", "replace")
        match = _REPORT_RE.match(message)
        if match and int(match.group(1)) < self.world_size:
            return message
        self._ignore(FAILED_KEY, message)
        return None

    def _ignore(self, key: str, value: str) -> None:
        if key not in self._ignored:
            self._ignored.add(key)
            _warn(f"graphc: rank {self.rank} ignores {key}={value[:60]!r} in the store: not a "
                  "value graphc writes (see docs/reliability.md, What to trust)")

    def _dead_successor(self) -> Optional[int]:
        """The watched peer if the OS says its process is gone and it is not done; a done
        peer hands the watch on to its own successor."""
        while self.watched is not None:
            if self._verdict() is not liveness.Verdict.GONE:
                return None
            if not self.keys.check([DONE_KEY.format(self.watched)]):
                return self.watched
            self._probe.close()
            self.watched, self._probe = self._successor(self.watched), None
        return None

    def _verdict(self) -> "liveness.Verdict":
        if self._probe is None:
            key = ALIVE_KEY.format(self.watched)
            if not self.keys.check([key]):  # its first step has not started its watchdog yet
                return liveness.Verdict.UNKNOWN
            raw = self.keys.get(key)
            address = liveness.parse_address(raw)
            if address is None:
                self._ignore(key, raw.decode("utf-8", "replace"))
                return liveness.Verdict.UNKNOWN
            self._probe = liveness.Probe(address, self.heartbeat_timeout)
        return self._probe.verdict()

    def _successor(self, peer: int) -> Optional[int]:
        nxt = (peer + 1) % self.world_size
        return None if nxt == self.rank else nxt

    def _declare_dead(self, peer: int) -> str:
        message = (f"rank {peer}: its process is gone (noticed by rank {self.rank}: its liveness "
                   "connection was closed or its host stopped answering); it died, was killed, or "
                   "its host is unreachable")
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
        if self._thread is not threading.current_thread() and self._thread.is_alive():
            self._thread.join(timeout=2 * POLL_SECONDS + 1 + liveness.CONNECT_SECONDS)
        for sock in (self._probe, self.listener):
            if sock is not None:
                sock.close()

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
    """GRAPHC_HEARTBEAT_TIMEOUT (seconds, default 10): how long a rank's host may leave TCP
    keepalive probes unanswered before the rank is dead (See NOTE: Liveness)."""
    return seconds_from_env("GRAPHC_HEARTBEAT_TIMEOUT", 10)


def _failed_rank_text(message: str) -> str:
    m = _PEER_RE.match(message)
    return f"rank {m.group(1)}" if m else "another rank"


_WATCHDOG: Optional[Watchdog] = None


def _watchdog() -> Optional[Watchdog]:
    """The process's watchdog, started on the first step of a multi-rank world."""
    global _WATCHDOG
    if world.torch_world() is None or dist.get_world_size() == 1:  # a local world: no processes to watch
        return None
    store = dist.distributed_c10d._get_default_store()
    if _WATCHDOG is not None and _WATCHDOG.store is not store:  # a new process group
        _WATCHDOG.mark_done()  # done with the old one: its closing port is no death there
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
        token = keys.compare_set(PAGE_KEY, "", shm.page_token()).decode("ascii", "replace")
    except Exception:
        return None
    path = shm.page_path(token)
    if path is None:  # not what a watchdog writes: someone else wrote the key
        _warn(f"graphc: ignoring the failure page name {token[:40]!r} read from the store (not a "
              "token graphc makes); failures still travel through the store and the transfers")
        return None
    try:
        sharers = host.SHARED_RANKS or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return shm.FailurePage(path, sharers)
    except (OSError, ValueError) as e:
        _warn(f"graphc: no failure page ({type(e).__name__}: {e}); failures still travel through "
              "the store and the transfers")
        return None


def _warn(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


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
