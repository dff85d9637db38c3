"""Atomic checkpoint files: a crash while saving keeps the last good checkpoint.

`graphc.save(obj, path)` writes to a temporary file in the same directory, flushes it to
disk, then renames it over `path` (os.replace is atomic on POSIX and Windows), so `path`
always holds either the old complete file or the new complete file, never a torn one.
A save killed mid-write leaves `<path>.<pid>.<random>.tmp` behind; the next save to
`path` deletes it.

The files are per rank: a DTensor (a split parameter's part of graph.state_dict()) is saved
as this rank's local part, so such a checkpoint resumes the same layout only. To change the
world size or layout, save with torch.distributed.checkpoint instead (docs/reliability.md).

Example:
    graphc.save(graph.state_dict(), f"ckpt/rank{rank}.pt")      # every rank, its own file
    graph.load_state_dict(graphc.load(f"ckpt/rank{rank}.pt"))   # before or after compiling
"""
from __future__ import annotations

import os
import re
import tempfile
from typing import Any

import torch

from .dcp import to_local_form
from .errors import GraphcError


def save(obj: Any, path: str) -> None:
    """Saves `obj` with torch.save to `path` atomically.

    Args:
        obj: what torch.save accepts, e.g. graph.state_dict() (DTensors in it are saved as
            their local parts).
        path: the destination; its directory must exist.
    """
    _check_path("graphc.save", path)
    if os.path.isdir(path):
        raise GraphcError(f"graphc.save: {path!r} is a directory; expected a file path. Fix: name a "
                          f"file in it, e.g. os.path.join({str(path)!r}, f\"rank{{rank}}.pt\").")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise GraphcError(f"graphc.save: the directory of {path!r} does not exist. Expected an "
                          f"existing directory; fix: os.makedirs({directory!r}, exist_ok=True) first.")
    _remove_stale_temporaries(path)
    # the writer's pid in the name tells a later save whether this file is still being written
    prefix = f"{os.path.basename(path)}.{os.getpid()}."
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(to_local_form(obj), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def load(path: str, map_location="cpu") -> Any:
    """Loads what graphc.save wrote (tensors land on `map_location`, the cpu by default)."""
    _check_path("graphc.load", path)
    if not os.path.exists(path):
        raise GraphcError(f"graphc.load: no checkpoint at {path!r}. Expected a file written by "
                          "graphc.save; fix: check the path, or start from scratch when none exists.")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise GraphcError(f"graphc.load: {path!r} is not a readable checkpoint ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}). Expected a complete file "
                          "written by graphc.save; fix: load an earlier checkpoint.") from e


def _check_path(what: str, path) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise GraphcError(f"{what} expects a file path (str or os.PathLike), found "
                          f"{type(path).__name__}. Fix: e.g. {what}("
                          + ("graph.state_dict(), " if what == "graphc.save" else "")
                          + "f\"ckpt/rank{rank}.pt\").")


def _remove_stale_temporaries(path: str) -> None:
    """Deletes `<path>.<pid>.<random>.tmp` files a killed save left behind.

    A file of a live process other than this one is kept: that process may be saving now.
    Names without a pid (older graphc) are stale by definition.
    """
    directory, base = os.path.split(os.path.abspath(path))
    # mkstemp's 8 random characters; exact, so another path's temporaries never match
    pattern = re.compile(re.escape(base) + r"\.(?:(\d+)\.)?[a-z0-9_]{8}\.tmp")
    for name in os.listdir(directory):
        match = pattern.fullmatch(name)
        if match is None:
            continue
        pid = match.group(1)
        if pid is not None and int(pid) != os.getpid() and _alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:  # another save removed it first
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists, owned by someone else; or no way to tell: keep the file
    return True


def _fsync_dir(directory: str) -> None:
    """Makes the rename itself durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
