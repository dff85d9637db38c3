"""Shared-memory point-to-point transport for ranks on one x86-64 host.

NOTE: Shared-memory channels
A channel is one direction of a rank pair: a ring of `slots` slots, each as large as the
channel's largest tensor, behind two counters on separate cache lines, `produced`
(written only by the sender) and `consumed` (only by the receiver). The sender copies a
tensor into slot seq % slots, then publishes produced = seq + 1; the receiver waits for
produced > seq, copies the tensor out, then publishes consumed = seq + 1. x86-64 keeps
stores in program order (TSO), so a published counter implies its data is visible; on
other machines graphc uses gloo instead. The ring holds all of one step's messages on
its channel, so a sender never waits inside a step and the bounded buffer adds no wait
that the plan verifier has not already proven deadlock-free. Messages are matched by
order, which the verifier checks is the same on both sides.
The counters are read and written as plain 8-byte words through ctypes, not as tensors:
a wait polls thousands of times, and a tensor read would put an `aten::item` per poll
into the user's torch.profiler trace (and cost a dispatcher call each).

NOTE: Failure page
Failure news must outlive the store, which rank 0 hosts: once rank 0 exits, a rank that
waits on nobody through a transfer would otherwise learn of a failure only at its
transfer timeout. So the ranks of one host also share a failure page, the file
/dev/shm/graphc-fail-<uid>-<token> (<uid>: this process's user id; <token>: 32 hex digits
from secrets.token_hex, which the first watchdog puts in the store under graphc/<restart>/,
so a restarted world gets a new page). The store is readable and writable by any of its
clients, so nothing read there is trusted: a token that is not exactly 32 lowercase hex
digits is ignored (no page: the store and transfers still carry failures), and the path is
built here, never taken from the store. The first rank of a host creates the file with
O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600, so a symlink or file planted at that name is never
followed or reused; the others open it with O_NOFOLLOW and use it only if it is a regular
file of this user, mode 0600, with one link. Every rank's watchdog maps the page and polls
it beside the store; a rank that
raises, declares a peer dead or exits for a peer's failure writes the message there
before the store, and keeps polling the page after the store is gone. Layout: the
message length (0: no failure yet) at byte 0, written after the text at byte 64; the
number of ranks that opened it at byte 8 and of those still holding it at byte 16. Writes
and the counts are under flock, and the first message wins. The rank whose open brings
the count to the number of ranks sharing this /dev/shm (host.SHARED_RANKS from the probe,
else LOCAL_WORLD_SIZE) unlinks the name: the mappings live on, and not even a SIGKILL can
leave the file behind. Failing that, the last rank to let go unlinks it (a clean exit or
an exit for a failure). Ranks on other hosts have their own page and still rely on the
store and the transfers.
"""
from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import platform
import re
import secrets
import stat
import time
from typing import Dict, Optional, Tuple

import torch

from ..errors import RankFailedError

_HEADER = 128          # produced at byte 0, consumed at byte 64
_ALIGN = 64


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


def free_bytes() -> int:
    """Free space in /dev/shm (0 where there is none)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def ring_bytes(slots: int, slot_bytes: int) -> int:
    return _HEADER + slots * (-(-max(slot_bytes, 1) // _ALIGN) * _ALIGN)


class ShmChannel:
    def __init__(self, path: str, slots: int, slot_bytes: int, create: bool):
        self.slots = slots
        self.slot_bytes = -(-max(slot_bytes, 1) // _ALIGN) * _ALIGN
        size = ring_bytes(slots, slot_bytes)
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)  # reserve now: no fault later when tmpfs is full
            finally:
                os.close(fd)
        elif not os.path.isfile(path):  # torch.from_file would create it: a leftover, and a hang
            raise RankFailedError(f"shared-memory ring {path} is not visible on this rank; its "
                                  "sender is on another host or /dev/shm (see NOTE: Same host)")
        self.mem = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        # aligned 8-byte words: a load or store of one is atomic on x86-64 (self.mem keeps them mapped)
        self.produced = ctypes.c_int64.from_address(self.mem.data_ptr())
        self.consumed = ctypes.c_int64.from_address(self.mem.data_ptr() + 64)
        self.seq = 0  # this side's next message number

    def slot(self, seq: int, nbytes: int) -> torch.Tensor:
        start = _HEADER + (seq % self.slots) * self.slot_bytes
        return self.mem[start:start + nbytes]


def pid_alive(pid: int) -> bool:
    """Whether process `pid` on this host still runs (the peer of a channel).

    A zombie (exited, not yet reaped by its parent) still answers kill(pid, 0) but will
    never send again, so it counts as dead.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1:2] for line in f)
    except OSError:  # gone meanwhile, or no /proc: kill(pid, 0) has answered
        return os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc")


def _wait(ready, deadline: float, what: str, peer: Tuple[int, int] = (-1, 0)) -> None:
    """Polls `ready`: a few tight checks, then yields the core, then sleeps with backoff.

    Ranks often outnumber cores, so a waiting rank must not burn the CPU that the rank
    it waits for needs. The peer shares this host, so a wait also ends as soon as the
    peer's process is gone, however it died.
    """
    spins, nap, next_check = 0, 1e-5, time.monotonic() + 0.2
    while not ready():
        spins += 1
        if spins < 16:
            continue
        if spins < 64:
            os.sched_yield()
            continue
        time.sleep(nap)
        nap = min(nap * 2, 5e-4)
        now = time.monotonic()
        if now > deadline:
            raise RankFailedError(what)
        if peer[1] and now > next_check:
            next_check = now + 0.2
            if not pid_alive(peer[1]) and not ready():
                raise RankFailedError(f"rank {peer[0]} failed: its process {peer[1]} exited "
                                      "while this rank was waiting on it")


class _Done:
    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _RecvWork:
    def __init__(self, transport: "ShmTransport", ch: ShmChannel, seq: int, out: torch.Tensor, peer: int):
        self.t, self.ch, self.seq, self.out, self.peer = transport, ch, seq, out, peer
        self.done = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout=None) -> bool:
        if self.done:
            return True
        ch, seq = self.ch, self.seq
        _wait(lambda: ch.produced.value > seq, time.monotonic() + self.t.timeout,
              f"rank {self.t.rank} waited {self.t.timeout:.0f}s for message {seq} from rank "
              f"{self.peer}; that rank has failed or stalled (GRAPHC_TIMEOUT sets the limit)",
              (self.peer, self.t.pids.get(self.peer, 0)))
        flat = self.out.view(-1).view(torch.uint8) if self.out.numel() else self.out.view(torch.uint8)
        flat.copy_(ch.slot(seq, flat.numel()))
        ch.consumed.value = seq + 1
        self.done = True
        return True


class ShmTransport:
    """isend/irecv over shared-memory rings, with the same call shape as torch.distributed."""

    def __init__(self, rank: int, channels: Dict[Tuple[int, int], ShmChannel], timeout: float,
                 pids: Dict[int, int] = None):
        self.rank, self.channels, self.timeout = rank, channels, timeout
        self.pids = pids or {}

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        ch = self.channels[(self.rank, peer)]
        seq = ch.seq
        _wait(lambda: seq - ch.consumed.value < ch.slots, time.monotonic() + self.timeout,
              f"rank {self.rank} waited {self.timeout:.0f}s for rank {peer} to take message "
              f"{seq - ch.slots}; that rank has failed or stalled", (peer, self.pids.get(peer, 0)))
        data = tensor.contiguous().view(-1).view(torch.uint8)
        ch.slot(seq, data.numel()).copy_(data)
        ch.produced.value = seq + 1
        ch.seq += 1
        return _Done()

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        ch = self.channels[(peer, self.rank)]
        work = _RecvWork(self, ch, ch.seq, tensor, peer)
        ch.seq += 1
        return work


PAGE_PREFIX = "/dev/shm/graphc-fail-"
_PAGE_BYTES = 4096
_TEXT = 64
_TOKEN = re.compile(r"[0-9a-f]{32}")


def page_token() -> str:
    """A fresh random token for a failure page's name (See NOTE: Failure page)."""
    return secrets.token_hex(16)


def page_path(token: str) -> Optional[str]:
    """The failure page's path for `token`, or None when `token` (read from the store, which
    any client may write) is not 32 lowercase hex digits."""
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        return None
    return f"{PAGE_PREFIX}{os.geteuid()}-{token}"


def _open_page_file(path: str) -> int:
    """Creates the page exclusively, or opens the one another rank of this host created;
    refuses a symlink, another user's file or a file with other links (See NOTE: Failure page)."""
    nofollow = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | nofollow, 0o600)
    except FileExistsError:
        pass
    fd = os.open(path, os.O_RDWR | nofollow)  # a symlink raises ELOOP here
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 or st.st_nlink != 1:
        os.close(fd)
        raise PermissionError(f"{path} is not a failure page this user created (mode "
                              f"{oct(st.st_mode)}, owner {st.st_uid}, {st.st_nlink} links)")
    return fd


class FailurePage:
    """The host's failure page (See NOTE: Failure page)."""

    def __init__(self, path: str, sharers: int):
        self.path = path
        self.fd = _open_page_file(path)
        self.closed = False
        with self._locked():
            if os.fstat(self.fd).st_size < _PAGE_BYTES:
                os.ftruncate(self.fd, _PAGE_BYTES)
            self.mem = mmap.mmap(self.fd, _PAGE_BYTES)
            self.length = ctypes.c_int64.from_buffer(self.mem, 0)
            opened = ctypes.c_int64.from_buffer(self.mem, 8)
            self.holders = ctypes.c_int64.from_buffer(self.mem, 16)
            opened.value += 1
            self.holders.value += 1
            if opened.value >= sharers:  # every rank of this host has it mapped
                _unlink(path)

    def _locked(self):
        fd = self.fd

        class _Lock:
            def __enter__(self):
                fcntl.flock(fd, fcntl.LOCK_EX)

            def __exit__(self, *exc):
                fcntl.flock(fd, fcntl.LOCK_UN)
        return _Lock()

    def read(self):
        """The failure written here, or None."""
        n = min(max(self.length.value, 0), _PAGE_BYTES - _TEXT)
        return self.mem[_TEXT:_TEXT + n].decode(errors="replace") if n else None

    def write(self, message: str) -> None:
        """Records `message` unless a failure is already recorded (the first one wins)."""
        data = message.encode()[:_PAGE_BYTES - _TEXT]
        with self._locked():
            if not self.length.value:
                self.mem[_TEXT:_TEXT + len(data)] = data
                self.length.value = len(data)  # published after the text (x86-64 TSO)

    def close(self) -> None:
        """This rank lets go; the last one unlinks the file if it is still named."""
        if self.closed:
            return
        self.closed = True
        with self._locked():
            self.holders.value -= 1
            if self.holders.value <= 0:
                _unlink(self.path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
