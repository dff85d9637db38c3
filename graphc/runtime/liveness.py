"""Whether a peer rank's process is alive, as the operating system answers it.

NOTE: Liveness
A watchdog must tell a dead rank from a slow one without asking the rank's Python: a rank
whose main thread holds the GIL inside a long C call (a ctypes call, a C extension that
does not release it) cannot run its watchdog thread, and a heartbeat counter it beats
would stop as if it had died. Only GRAPHC_TIMEOUT may judge a live rank. So every rank
opens a listening TCP socket that nobody ever accepts on and publishes its address
("<host> <port>") in the store under alive/<rank>; the rank that watches it connects
once. The kernel completes and keeps that connection whatever the process's threads do,
and closes it when the process exits however it ends (SIGKILL and the OOM killer included;
a zombie's sockets are already closed). The watcher peeks at the connection without
blocking: nothing to read means alive, end-of-file or a reset means the process is gone.
TCP keepalive probes, which the peer's kernel answers, bound how long a host that vanished
(power loss, network cut) goes unnoticed: about GRAPHC_HEARTBEAT_TIMEOUT seconds. A
connection refused by the peer's host also means no such process is listening any more.
Anything else (a timeout, an unreachable address) is no answer, never a death.
The address comes from the store, which any client may write: one that is not
"<host> <port>" is ignored.
"""
from __future__ import annotations

import enum
import os
import re
import socket
from typing import Optional, Tuple

_ADDRESS = re.compile(r"([0-9A-Za-z.:%_-]{1,255}) ([0-9]{1,5})")
CONNECT_SECONDS = 1.0  # the watchdog thread waits this long at most for a connect


class Verdict(enum.Enum):
    ALIVE = "alive"
    GONE = "gone"        # the OS says the process exited (or its host stopped answering)
    UNKNOWN = "unknown"  # no answer yet: never taken for a death


class Listener:
    """This rank's liveness port: a listening socket nobody accepts on (See NOTE: Liveness)."""

    def __init__(self, backlog: int):
        host = local_address()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(max(backlog, 16))
        self.address = f"{host} {self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()


def parse_address(raw) -> Optional[Tuple[str, int]]:
    """(host, port) of a published liveness address, or None if it is not one."""
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else str(raw)
    match = _ADDRESS.fullmatch(text)
    if match is None or not 0 < int(match.group(2)) < 65536:
        return None
    return match.group(1), int(match.group(2))


class Probe:
    """A connection to one peer's liveness port; verdict() asks the kernel, not the peer."""

    def __init__(self, address: Tuple[str, int], silence_seconds: float):
        self.address, self.silence = address, silence_seconds
        self.sock: Optional[socket.socket] = None
        self.refused = False

    def verdict(self) -> Verdict:
        if self.sock is None and not self._connect():
            return Verdict.GONE if self.refused else Verdict.UNKNOWN
        try:
            data = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return Verdict.ALIVE
        except OSError:  # reset by the peer's kernel, or keepalive gave up (ETIMEDOUT)
            return Verdict.GONE
        return Verdict.ALIVE if data else Verdict.GONE

    def _connect(self) -> bool:
        self.refused = False
        try:
            self.sock = socket.create_connection(self.address, timeout=CONNECT_SECONDS)
        except ConnectionRefusedError:
            self.refused = True
            return False
        except OSError:
            return False
        _keepalive(self.sock, self.silence)
        self.sock.setblocking(False)
        return True

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _keepalive(sock: socket.socket, seconds: float) -> None:
    """Probes an idle connection so that a vanished host is noticed after about `seconds`."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    half = max(1, int(seconds / 2))
    for name, value in (("TCP_KEEPIDLE", half), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", half)):
        if hasattr(socket, name):  # Linux; elsewhere the system's keepalive timings apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def local_address() -> str:
    """The address of this host that peers reach it by: the one its route to MASTER_ADDR
    leaves from (no packet is sent), else its hostname's, else the loopback address."""
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            family, _, _, _, where = socket.getaddrinfo(master, 9, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(where)
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
