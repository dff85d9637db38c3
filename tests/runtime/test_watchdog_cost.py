"""The watchdog's store traffic grows with the world, not its square (NOTE: Watchdog cost).

A logic-only test in one process: `world` watchdogs (threads not started) share a store
stand-in that counts requests, and tick on a simulated clock every POLL_SECONDS, as their
threads would. It claims nothing about torch.distributed itself.
"""
import pytest

from graphc.runtime import watchdog
from graphc.runtime.watchdog import BEAT_SECONDS, POLL_SECONDS, Watchdog

SECONDS = 20  # simulated; longer than the heartbeat timeout below
SILENT_FROM = 3.0  # simulated second at which a `silent` rank stops (dies)
PER_RANK_BOUND = 1 / POLL_SECONDS + 2 / BEAT_SECONDS  # failure polls + own beat + one peer read


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


def _simulate(world, seconds=SECONDS, silent=(), done=()):
    """Ticks every live rank's watchdog; returns (requests per second, exit messages).

    Ranks in `silent` stop ticking at SILENT_FROM (they die); ranks in `done` exited normally.
    """
    store = CountingStore()
    dogs = [Watchdog(store, r, world, store, start=False) for r in range(world)]
    for r in done:
        dogs[r].mark_done()
    store.requests = 0  # count the watching only
    messages, t = {}, 0.0
    for step in range(int(seconds / POLL_SECONDS)):
        t = step * POLL_SECONDS
        for dog in dogs:
            if (dog.rank in silent and t >= SILENT_FROM) or dog.rank in done or dog.rank in messages:
                continue
            message = dog.tick(t)
            if message:
                messages[dog.rank] = message
    return store.requests / seconds, messages


@pytest.fixture(autouse=True)
def _short_heartbeat(monkeypatch):
    monkeypatch.setenv("GRAPHC_HEARTBEAT_TIMEOUT", "5")


@pytest.mark.parametrize("world", [8, 64, 256])
def test_store_requests_per_second_grow_linearly_with_the_world(world):
    rate, messages = _simulate(world)
    print(f"world {world}: {rate:.0f} store requests/s, {rate / world:.2f} per rank")
    assert messages == {}
    assert rate <= PER_RANK_BOUND * world


def test_a_silent_rank_is_declared_dead_by_its_predecessor_and_everyone_hears():
    _, messages = _simulate(8, silent={5})
    assert messages[4].startswith("rank 5: no heartbeat for 5s (noticed by rank 4)")
    assert set(messages) == set(range(8)) - {5}  # the rest read it from FAILED_KEY


def test_a_done_rank_hands_the_watch_on_to_its_successor():
    """Rank 5 exits normally, rank 6 then dies: rank 4, which watched 5, notices 6."""
    _, messages = _simulate(8, silent={6}, done={5})
    assert messages[4].startswith("rank 6: no heartbeat for 5s (noticed by rank 4)")
    assert set(messages) == set(range(8)) - {5, 6}


def test_a_lone_survivor_watches_nobody():
    rate, messages = _simulate(3, done={1, 2})
    assert messages == {} and rate <= PER_RANK_BOUND
