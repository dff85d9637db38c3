"""The watchdog's store traffic grows with the world, not its square (NOTE: Watchdog cost).

A logic-only test in one process: `world` watchdogs (threads not started) share a store
stand-in that counts requests, and tick on a simulated clock every POLL_SECONDS, as their
threads would. Each has its real liveness port (NOTE: Liveness, on this host's loopback);
a rank dies by closing it, as its process's exit would. It claims nothing about
torch.distributed itself.
"""
import pytest

from graphc.runtime import watchdog
from graphc.runtime.watchdog import LIVENESS_SECONDS, POLL_SECONDS, Watchdog

SECONDS = 20  # simulated
SILENT_FROM = 3.0  # simulated second at which a `silent` or `dead` rank stops ticking
PER_RANK_BOUND = 1 / POLL_SECONDS + 1 / LIVENESS_SECONDS  # failure polls + the watched rank's address


class CountingStore:
    """A dict with the store calls the watchdog makes, counting each as one request."""

    def __init__(self):
        self.data, self.requests = {}, 0

    def check(self, keys):
        self.requests += 1
        return all(k in self.data for k in keys)

    def get(self, key):
        self.requests += 1
        return self.data[key]

    def set(self, key, value):
        self.requests += 1
        self.data[key] = value.encode() if isinstance(value, str) else value

    def add(self, key, n):
        self.requests += 1
        self.data[key] = self.data.get(key, 0) + n
        return self.data[key]


def _simulate(world, seconds=SECONDS, silent=(), done=(), dead=()):
    """Ticks every live rank's watchdog; returns (requests per second, exit messages).

    Ranks in `silent` and `dead` stop ticking at SILENT_FROM; a `dead` one's process exits
    then (its liveness port closes), a `silent` one's lives on (a C call holding the GIL).
    Ranks in `done` exited normally.
    """
    store = CountingStore()
    dogs = [Watchdog(store, r, world, store, start=False) for r in range(world)]
    try:
        for r in done:
            dogs[r].mark_done()
            dogs[r].stop()
        store.requests = 0  # count the watching only
        messages, t = {}, 0.0
        for step in range(int(seconds / POLL_SECONDS)):
            t = step * POLL_SECONDS
            for dog in dogs:
                stopped = dog.rank in set(silent) | set(dead) and t >= SILENT_FROM
                if dog.rank in dead and stopped and dog.listener.sock.fileno() >= 0:
                    dog.listener.close()
                if stopped or dog.rank in done or dog.rank in messages:
                    continue
                message = dog.tick(t)
                if message:
                    messages[dog.rank] = message
        return store.requests / seconds, messages
    finally:
        for dog in dogs:
            dog.stop()


@pytest.fixture(autouse=True)
def _short_heartbeat(monkeypatch):
    monkeypatch.setenv("GRAPHC_HEARTBEAT_TIMEOUT", "5")


@pytest.mark.parametrize("world", [8, 64, 256])
def test_store_requests_per_second_grow_linearly_with_the_world(world):
    rate, messages = _simulate(world)
    print(f"world {world}: {rate:.0f} store requests/s, {rate / world:.2f} per rank")
    assert messages == {}
    assert rate <= PER_RANK_BOUND * world


def test_a_dead_rank_is_declared_dead_by_its_predecessor_and_everyone_hears():
    _, messages = _simulate(8, dead={5})
    assert messages[4].startswith("rank 5: its process is gone (noticed by rank 4")
    assert set(messages) == set(range(8)) - {5}  # the rest read it from FAILED_KEY


def test_a_silent_live_rank_is_never_declared_dead():
    """Rank 5 stops ticking for 17 simulated seconds, longer than GRAPHC_HEARTBEAT_TIMEOUT,
    but its process lives (a C call holding the GIL): only GRAPHC_TIMEOUT may judge it."""
    _, messages = _simulate(8, silent={5})
    assert messages == {}


def test_a_done_rank_hands_the_watch_on_to_its_successor():
    """Rank 5 exits normally, rank 6 then dies: rank 4, which watched 5, notices 6."""
    _, messages = _simulate(8, dead={6}, done={5})
    assert messages[4].startswith("rank 6: its process is gone (noticed by rank 4")
    assert set(messages) == set(range(8)) - {5, 6}


def test_forged_store_values_are_ignored_not_obeyed():
    """Values no watchdog writes, in the keys the watchdogs read: a failure report that does
    not start 'rank <r>: ', a liveness address that is not '<host> <port>'. Nobody exits."""
    store = CountingStore()
    dogs = [Watchdog(store, r, 3, store, start=False) for r in range(3)]
    try:
        store.set(watchdog.FAILED_KEY, b"\xff\xfe garbage")
        store.set(watchdog.ALIVE_KEY.format(1), "../../etc/passwd; rm")
        assert [dog.tick(float(t)) for t in range(3) for dog in dogs] == [None] * 9
        store.set(watchdog.FAILED_KEY, "rank 7: a rank this world does not have")
        assert [dog.tick(3.0) for dog in dogs] == [None] * 3
        store.set(watchdog.FAILED_KEY, "rank 2: ValueError: a real report")
        assert dogs[0].tick(4.0) == "rank 2: ValueError: a real report"
    finally:
        for dog in dogs:
            dog.stop()


def test_a_lone_survivor_watches_nobody():
    rate, messages = _simulate(3, done={1, 2})
    assert messages == {} and rate <= PER_RANK_BOUND
