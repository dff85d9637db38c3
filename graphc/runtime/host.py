"""Which ranks truly share a host, and so may share memory.

NOTE: Same host
A hostname match is not enough: two machines (or containers) can carry the same name,
and two ranks on one machine can see different /dev/shm (private mount namespaces).
Mapping a ring across such ranks hangs both until GRAPHC_TIMEOUT. Two ranks share
memory only if both hold:
  1. Their host identity matches: hostname, machine-id (/etc/machine-id, else
     /var/lib/dbus/machine-id) and boot-id (/proc/sys/kernel/random/boot_id, new at each
     boot). A missing file counts as empty; the probe still decides.
  2. The probe succeeds both ways: each rank creates a small file in /dev/shm holding a
     random nonce, and each rank of the same identity opens its peer's file (read-only,
     never creating it) and reads the nonce back.
Every rank gathers every rank's findings, so all ranks take the same decision; pairs
that fail either test use gloo. The probe files are unlinked right after.
"""
from __future__ import annotations

import os
import socket
import uuid
from typing import List, Tuple

import torch.distributed as dist

from . import shm

PROBE_DIR = "/dev/shm"
PROBE_PREFIX = "graphc-probe-"
_MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id")
_BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
# ranks that share this rank's /dev/shm, itself included, as the last probe found
# (None before any probe): how many will map the failure page (NOTE: Failure page in shm.py)
SHARED_RANKS = None


def host_identity() -> str:
    """hostname/machine-id/boot-id of this host (see NOTE: Same host)."""
    machine = next((t for t in map(_read_text, _MACHINE_ID_FILES) if t), "")
    return f"{socket.gethostname()}/{machine}/{_read_text(_BOOT_ID_FILE)}"


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def shared_memory_groups(probe: bool) -> Tuple[List[int], List[int], List[int]]:
    """(group, free /dev/shm bytes, pid) per rank. Collective: every rank calls it.

    Ranks with equal group truly share memory (the group is its lowest rank); with
    probe=False every rank is its own group.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    nonce = uuid.uuid4().hex
    made = probe and _create_probe(nonce)
    infos = [None] * world
    dist.all_gather_object(infos, (host_identity(), shm.free_bytes(), os.getpid(),
                                   nonce if made else None))
    try:  # every probe file exists now: each rank created its own before the gather
        mine = infos[rank][0]
        seen = [r for r, (ident, _, _, theirs) in enumerate(infos)
                if made and r != rank and theirs and ident == mine and _read_probe(theirs)]
        seen_by = [None] * world
        dist.all_gather_object(seen_by, seen)
    finally:
        if made:
            shm._unlink(_probe_path(nonce))
    group = [min([r] + [s for s in seen_by[r] if r in seen_by[s]]) for r in range(world)]
    if probe:
        global SHARED_RANKS
        SHARED_RANKS = group.count(group[rank]) if made else 1
    free = [min(f for g, (_, f, _, _) in zip(group, infos) if g == group[r]) for r in range(world)]
    return group, free, [pid for _, _, pid, _ in infos]


def _probe_path(nonce: str) -> str:
    return os.path.join(PROBE_DIR, PROBE_PREFIX + nonce)


def _create_probe(nonce: str) -> bool:
    try:
        fd = os.open(_probe_path(nonce), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    try:
        os.write(fd, nonce.encode())
        return True
    except OSError:
        shm._unlink(_probe_path(nonce))
        return False
    finally:
        os.close(fd)


def _read_probe(nonce: str) -> bool:
    """Whether the peer's probe file is visible here: opened (never created), same nonce."""
    try:
        fd = os.open(_probe_path(nonce), os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.read(fd, 64).decode(errors="replace") == nonce
    except OSError:
        return False
    finally:
        os.close(fd)


