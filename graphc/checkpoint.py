"""Atomic checkpoint files: a crash while saving keeps the last good checkpoint.

`graphc.save(obj, path)` writes to a temporary file in the same directory, flushes it to
disk, then renames it over `path` (os.replace is atomic on POSIX and Windows), so `path`
always holds either the old complete file or the new complete file, never a torn one.

Example:
    graphc.save(graph.state_dict(), f"ckpt/rank{rank}.pt")      # every rank, its own file
    graph.load_state_dict(graphc.load(f"ckpt/rank{rank}.pt"))   # before or after compiling
"""
from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from .errors import GraphcError


def save(obj: Any, path: str) -> None:
    """Saves `obj` with torch.save to `path` atomically.

    Args:
        obj: what torch.save accepts, e.g. graph.state_dict().
        path: the destination; its directory must exist.
    """
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise GraphcError(f"graphc.save: the directory of {path!r} does not exist. Expected an "
                          f"existing directory; fix: os.makedirs({directory!r}, exist_ok=True) first.")
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
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
    if not os.path.exists(path):
        raise GraphcError(f"graphc.load: no checkpoint at {path!r}. Expected a file written by "
                          "graphc.save; fix: check the path, or start from scratch when none exists.")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise GraphcError(f"graphc.load: {path!r} is not a readable checkpoint ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}). Expected a complete file "
                          "written by graphc.save; fix: load an earlier checkpoint.") from e


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
