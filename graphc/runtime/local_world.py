"""A local world: every rank of a job is a thread of this one process.

NOTE: Local world
`graphc check` and `graphc.testing.local_world` run N ranks' unchanged programs (the user's
script or a graph factory, graphc's compile, plans, stage programs and instruction loop) as
N threads; only the transport differs (NOTE: Worlds, graphc/world.py): transfers and
collectives move tensors between the threads in memory.

One rank runs Python at a time. A thread holds the baton while it runs and hands it on
only when it blocks (a receive, a collective, a store key not yet written), as a process
gives up the CPU; whichever blocked rank can proceed takes it next. So a rank's own
Python state can be swapped in with the baton, as if each rank were a process: torch's
default generator, Python's and NumPy's random state, the default dtype, and RANK /
LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE in os.environ. Every rank starts from the
state of the thread that started the world (N processes launched alike), and computes on
one intra-op thread, as torchrun's ranks do (OMP_NUM_THREADS=1): a kernel's reduction order
depends on its thread count.

Collectives (LocalRank, local_rank.py) combine the ranks' tensors in the group's rank order (a sum is
((x0 + x1) + x2) + ...), so a run is deterministic; with two ranks per group it is
bitwise what gloo computes, with more the order of a sum may differ from gloo's ring by
rounding. A world where every unfinished rank waits and none can proceed is a deadlock:
a LocalDeadlock lists, rank by rank, what each waits for (or that it finished).
"""
from __future__ import annotations

import os
import random
import sys
import itertools
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import world as worlds
from ..errors import GraphcError
from .local_rank import LocalRank, LocalStore, Ranks, sum_in_order

# a rank's calls (LocalRank, LocalStore, sum_in_order) live in local_rank.py; imported from here too
__all__ = ["LocalWorld", "LocalDeadlock", "LocalWorldStopped", "LocalRank", "LocalStore", "sum_in_order",
           "hold_fake_cuda_guard"]
_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


class LocalDeadlock(GraphcError):
    """Every unfinished rank of a local world waits, and none can proceed."""


class LocalWorldStopped(Exception):
    """Raised in the other ranks' threads once one rank failed or the world deadlocked."""


@dataclass
class _ProcessState:
    """What a process holds alone and a thread shares: swapped in with the baton."""

    torch_rng: torch.Tensor
    py_rng: object
    np_rng: object
    dtype: torch.dtype

    @staticmethod
    def capture() -> "_ProcessState":
        np = sys.modules.get("numpy")
        return _ProcessState(torch.get_rng_state(), random.getstate(),
                             np.random.get_state() if np is not None else None, torch.get_default_dtype())

    def restore(self) -> None:
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.py_rng)
        np = sys.modules.get("numpy")
        if np is not None and self.np_rng is not None:
            np.random.set_state(self.np_rng)
        torch.set_default_dtype(self.dtype)


@dataclass
class _Slot:
    """One collective call on one group: every member's contribution, then the result."""

    kind: str
    ranks: Ranks
    call: int
    data: Dict[int, Any] = field(default_factory=dict)
    result: Any = None
    done: bool = False
    taken: int = 0


_WORLDS = itertools.count()   # every local world made in this process, numbered


# NOTE: Fake CUDA guard of a thread
# Entering a FakeTensorMode (graphc traces build() on fakes; compile_fx traces on fakes too)
# calls torch._C._ensureCUDADeviceGuardSet(). On a CUDA build of torch that sees no GPU (the
# lent machines' 2.11.0+cu130 wheel on a CPU host; any CUDA wheel with no device visible)
# that C function, finding the CUDA guard's deviceCount() 0, makes a no-op guard held in a
# *thread_local* unique_ptr and stores its raw pointer in the process-wide guard registry
# (c10/core/impl/DeviceGuardImplInterface.cpp). The first thread to enter a fake mode owns
# the process's CUDA guard: when that thread ends its guard is freed, the registry keeps the
# dangling pointer, and the next fake mode entered on any thread calls deviceCount() through
# it -- a segfault in FakeTensorMode.__enter__ or compile_fx, or none, as freed memory happens
# to be reused. A local world's rank threads end after every run, so whenever a rank thread
# traced first (tests/local run alone; a compile in rank threads, then one on the main
# thread) the process crashed; a run whose main thread traced first was safe (2.11's
# one-process loop of 2026-11-27). So before a world's ranks start, a thread that never ends
# makes that call once: the guard it installs reports devices, later calls keep it, and no
# rank thread makes its own. CPU wheels register no CUDA guard (the call does nothing) and a
# GPU host's guard reports its devices: there, no thread is started. Torch 2.13's
# FakeTensorMode makes the same call, so a 2.13 CUDA wheel without a GPU needs this too.
_GUARD_HELD = threading.Event()
_GUARD_LOCK = threading.Lock()


def hold_fake_cuda_guard() -> None:
    """Install torch's no-op CUDA guard from a thread that lives as long as the process
    (See NOTE: Fake CUDA guard of a thread), once, where torch would install it at all."""
    with _GUARD_LOCK:
        if _GUARD_HELD.is_set() or not torch.backends.cuda.is_built() or torch.cuda.device_count() > 0:
            return

        def hold() -> None:
            torch._C._ensureCUDADeviceGuardSet()
            _GUARD_HELD.set()
            threading.Event().wait()   # never set: the thread, and its thread_local guard, live on

        threading.Thread(target=hold, name="graphc-cuda-guard", daemon=True).start()
        _GUARD_HELD.wait()


class LocalWorld:
    """N ranks as threads of this process (See NOTE: Local world)."""

    def __init__(self, size: int):
        if size < 1:
            raise GraphcError(f"a local world needs at least one rank, asked for {size}")
        self.size = size
        self.serial = next(_WORLDS)   # names this world for per-process state (not id(): reused)
        self.cond = threading.Condition()
        self.owner: Optional[int] = None            # the rank running Python (holds the baton)
        self.waiting: Dict[int, Tuple[Callable[[], str], Callable[[], bool]]] = {}
        self.running: set = set()
        self.finished: set = set()
        self.failure: Optional[BaseException] = None
        self.mail: Dict[Tuple[int, int, int], deque] = defaultdict(deque)
        self.slots: Dict[Tuple[Ranks, int], _Slot] = {}
        self.calls: Dict[Tuple[Ranks, int], int] = defaultdict(int)
        self.kv: Dict[str, bytes] = {}
        self.states: Dict[int, _ProcessState] = {}
        self.ranks = [LocalRank(self, r) for r in range(size)]

    # -- running ranks ----------------------------------------------------------------
    def run(self, fn: Callable[[int], Any]) -> List[Any]:
        """fn(rank) on every rank, each a thread in this world; their results in rank order.
        The first rank's error (or a LocalDeadlock) is raised once every thread ended."""
        start = _ProcessState.capture()
        self.states = {r: start for r in range(self.size)}
        self.running, self.finished, self.failure = set(range(self.size)), set(), None
        results: List[Any] = [None] * self.size
        errors: Dict[int, BaseException] = {}
        env = {k: os.environ.get(k) for k in _ENV}

        def body(r: int) -> None:
            with worlds.entered(self.ranks[r]):
                try:
                    self._take(r)
                    results[r] = fn(r)
                except BaseException as exc:  # noqa: BLE001 - reported for the rank
                    errors[r] = exc
                    with self.cond:
                        if self.failure is None and not isinstance(exc, LocalWorldStopped):
                            self.failure = exc
                        self.cond.notify_all()
                finally:
                    with self.cond:
                        if self.owner == r:
                            self._release(r)
                        self.running.discard(r)
                        self.finished.add(r)
                        self._check_deadlock()
                        self.cond.notify_all()

        hold_fake_cuda_guard()   # before any rank thread traces (NOTE: Fake CUDA guard of a thread)
        threads = [threading.Thread(target=body, args=(r,), name=f"graphc-local-rank{r}", daemon=True)
                   for r in range(self.size)]
        intra_op = torch.get_num_threads()
        torch.set_num_threads(1)  # a rank computes on one thread, as under torchrun (OMP_NUM_THREADS=1)
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            torch.set_num_threads(intra_op)
            start.restore()
            for k, v in env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if self.failure is not None:
            raise self.failure
        return results

    def _take(self, r: int) -> None:
        """Rank r takes the baton (waits for it)."""
        with self.cond:
            while self.owner is not None:
                self.cond.wait()
            self._own(r)

    def _own(self, r: int) -> None:
        """Under the lock, the baton free: rank r holds it, and its process state comes back."""
        self.owner = r
        self.states[r].restore()
        os.environ.update({"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(self.size),
                           "LOCAL_WORLD_SIZE": str(self.size)})

    def _release(self, r: int) -> None:
        self.states[r] = _ProcessState.capture()
        self.owner = None
        self.cond.notify_all()

    def block(self, r: int, what: Callable[[], str], ready: Callable[[], bool]) -> None:
        """Rank r waits until `ready()` (checked under the world's lock), the baton given up
        meanwhile; `what` says what it waits for, in a deadlock report."""
        with self.cond:
            if self.failure is not None:
                raise LocalWorldStopped(f"rank {r}: stopped, another rank failed")
            if ready():
                return
            self._release(r)
            self.waiting[r] = (what, ready)
            self._check_deadlock()
            try:
                while not (self.failure is None and ready() and self.owner is None):
                    if self.failure is not None:
                        raise LocalWorldStopped(f"rank {r}: stopped, another rank failed")
                    self.cond.wait(timeout=5.0)
            finally:
                self.waiting.pop(r, None)
            self._own(r)

    def _check_deadlock(self) -> None:
        """Under the lock: every unfinished rank waits and none can go on -> LocalDeadlock."""
        if self.failure is not None or self.owner is not None or not self.running:
            return
        if set(self.waiting) != self.running or any(ready() for _, ready in self.waiting.values()):
            return
        lines = []
        for r in range(self.size):
            if r in self.waiting:
                lines.append(f"rank {r}: waits for {self.waiting[r][0]()}")
            else:
                lines.append(f"rank {r}: finished")
        self.failure = LocalDeadlock(
            "deadlock in the local world: every rank that has not finished waits, and none can "
            "proceed:\n  " + "\n  ".join(lines) + "\n  A rank waits for a transfer or collective "
            "that its peer never makes: the ranks ran different programs (a rank that skipped "
            "a graph call, a collective only some ranks reach), or a plan does not pair.")
        self.cond.notify_all()

    # -- collectives (used through LocalRank) ------------------------------------------
    def join(self, r: int, kind: str, ranks: Ranks, data: Any, combine: Callable[[Dict[int, Any]], Any]) -> _Slot:
        with self.cond:
            call = self.calls[(ranks, r)]
            self.calls[(ranks, r)] = call + 1
            slot = self.slots.get((ranks, call))
            if slot is None:
                slot = self.slots[(ranks, call)] = _Slot(kind, ranks, call)
            elif slot.kind != kind:
                self.failure = GraphcError(
                    f"collective mismatch in the local world: on ranks {list(ranks)} (their call "
                    f"{call} on that group) rank(s) {sorted(slot.data)} called {slot.kind} but rank {r} "
                    f"called {kind}. The ranks' programs disagree; with processes this would hang.")
                self.cond.notify_all()
                raise self.failure
            slot.data[r] = data
            if len(slot.data) == len(ranks):
                slot.result = combine(slot.data)
                slot.done = True
                self.cond.notify_all()
            return slot

    def collect(self, r: int, slot: _Slot) -> Any:
        """Waits for a collective's result; the slot goes once every member has it."""
        def what() -> str:
            missing = [x for x in slot.ranks if x not in slot.data]
            return (f"{slot.kind} over ranks {list(slot.ranks)} (call {slot.call} on that group), "
                    f"which rank(s) {missing} have not joined")
        self.block(r, what, lambda: slot.done)
        with self.cond:
            slot.taken += 1
            if slot.taken == len(slot.ranks):
                self.slots.pop((slot.ranks, slot.call), None)
        return slot.result
