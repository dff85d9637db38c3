"""Atomic checkpoint files: a crash while saving keeps the last good checkpoint.

`graphc.save(obj, path)` writes to a temporary file in the same directory, flushes it to
disk, then renames it over `path` (os.replace is atomic on POSIX and Windows), so `path`
always holds either the old complete file or the new complete file, never a torn one.
A save killed mid-write leaves `<path>.<pid>.<random>.tmp` behind; the next save to
`path` deletes it.

Each file starts with a checksum line, `graphc-checkpoint sha256:<64 hex digits>`, the
sha256 of the torch.save payload that follows it; graphc.load verifies it before unpickling
anything, so a flipped bit is an error naming the file, not a silently different model
(files written by graphc before checksums, which start with torch's own zip header, load
unchecked). What graphc.save writes must load with graphc.load (torch.load with
weights_only=True): numpy scalars (a numpy.float64 learning rate in optimizer param groups or
LR scheduler state) are stored as Python numbers, and any other value torch.load would refuse
is refused at save time, naming where it is.

The files are per rank: a DTensor (a split parameter's part of graph.state_dict()) is saved
as this rank's local part, so such a checkpoint resumes the same layout only. To change the
world size or layout, save with torch.distributed.checkpoint instead (docs/reliability.md).

Example:
    graphc.save(graph.state_dict(), f"ckpt/rank{rank}.pt")      # every rank, its own file
    graph.load_state_dict(graphc.load(f"ckpt/rank{rank}.pt"))   # before or after compiling
"""
from __future__ import annotations

import errno
import hashlib
import io
import os
import re
import tempfile
from collections import OrderedDict
from typing import Any, Optional

import torch

from .dcp_load import to_local_form
from ..errors import GraphcError


def save(obj: Any, path: str) -> None:
    """Saves `obj` with torch.save to `path` atomically, behind a checksum line.

    Args:
        obj: what torch.save accepts, e.g. graph.state_dict() (DTensors in it are saved as
            their local parts, numpy scalars as Python numbers).
        path: the destination; its directory must exist.

    Raises:
        GraphcError: `obj` holds a value graphc.load could not read back (nothing is
            written), or the disk is full (the previous file at `path` is kept).
    """
    _check_path("graphc.save", path)
    if os.path.isdir(path):
        raise GraphcError(f"graphc.save: {path!r} is a directory; expected a file path. Fix: name a "
                          f"file in it, e.g. os.path.join({str(path)!r}, f\"rank{{rank}}.pt\").")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise GraphcError(f"graphc.save: the directory of {path!r} does not exist. Expected an "
                          f"existing directory; fix: os.makedirs({directory!r}, exist_ok=True) first.")
    obj = loadable_form(to_local_form(obj))
    _check_loadable(obj, path)
    _remove_stale_temporaries(path)
    # the writer's pid in the name tells a later save whether this file is still being written
    prefix = f"{os.path.basename(path)}.{os.getpid()}."
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=directory)
    writer = None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_header("0" * 64))  # the real digest once the payload is written
            writer = _HashingWriter(f)
            torch.save(obj, writer)
            f.seek(0)
            f.write(_header(writer.sha256.hexdigest()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if _no_space(e, writer):
            raise GraphcError(
                f"graphc.save: no space left on device while writing {path!r} (in {directory!r}). "
                f"Expected room for the checkpoint; found the disk full. The previous file at "
                f"{path!r}, if any, is intact. Fix: free space there, or save to another "
                "directory.") from e
        raise
    _fsync_dir(directory)


def load(path: str, map_location="cpu") -> Any:
    """Loads what graphc.save wrote (tensors land on `map_location`, the cpu by default),
    after checking the file's checksum."""
    _check_path("graphc.load", path)
    if not os.path.exists(path):
        raise GraphcError(f"graphc.load: no checkpoint at {path!r}. Expected a file written by "
                          "graphc.save; fix: check the path, or start from scratch when none exists.")
    with open(path, "rb") as f:
        start = f.read(len(_ZIP_MAGIC))
        f.seek(0)
        payload = f if start == _ZIP_MAGIC else _verified_payload(f, path)  # older: no checksum
        try:
            return torch.load(payload, map_location=map_location, weights_only=True)
        except Exception as e:
            raise GraphcError(f"graphc.load: {path!r} is not a readable checkpoint ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}). Expected a complete file "
                              "written by graphc.save; fix: load an earlier checkpoint.") from e


# -- the file format: a checksum line, then torch.save's payload ------------------------------
_HEADER_START = b"graphc-checkpoint sha256:"
_HEADER_BYTES = len(_HEADER_START) + 64 + 1
_ZIP_MAGIC = b"PK\x03\x04"  # what torch.save's files start with (graphc before checksums)
_CHUNK = 1 << 20


def _header(digest: str) -> bytes:
    return _HEADER_START + digest.encode() + b"\n"


class _HashingWriter:
    """The file object torch.save writes to: hashes what passes through, and remembers an
    OSError (torch's writer turns it into a RuntimeError that no longer says why)."""

    def __init__(self, f):
        self.f, self.sha256, self.error = f, hashlib.sha256(), None

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.sha256.update(data)
        return n

    def flush(self) -> None:
        self.f.flush()


class _Payload(io.RawIOBase):
    """The file after its checksum line, as a seekable file of its own (torch.load seeks)."""

    def __init__(self, f):
        self.f = f
        f.seek(_HEADER_BYTES)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self.f.readinto(buffer)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        offset += _HEADER_BYTES if whence == io.SEEK_SET else 0
        return self.f.seek(offset, whence) - _HEADER_BYTES

    def tell(self) -> int:
        return self.f.tell() - _HEADER_BYTES


def _verified_payload(f, path: str) -> _Payload:
    header = f.read(_HEADER_BYTES)
    want = header[len(_HEADER_START):-1].decode("ascii", "replace")
    if not header.startswith(_HEADER_START) or not re.fullmatch(r"[0-9a-f]{64}", want):
        raise GraphcError(f"graphc.load: {path!r} is not a readable checkpoint: it starts with neither "
                          "graphc's checksum line nor torch's zip header. Expected a file written by "
                          "graphc.save; fix: check the path, or load an earlier checkpoint.")
    digest = hashlib.sha256()
    for chunk in iter(lambda: f.read(_CHUNK), b""):
        digest.update(chunk)
    if digest.hexdigest() != want:
        raise GraphcError(f"graphc.load: {path!r} is corrupt: its checksum (sha256) does not match "
                          f"its contents (recorded {want[:16]}..., found {digest.hexdigest()[:16]}...). "
                          "Expected the bytes graphc.save wrote; found them changed on disk or in "
                          "transfer. Fix: load an earlier checkpoint, or copy this one again from "
                          "its source.")
    return _Payload(f)


def _no_space(e: BaseException, writer: Optional[_HashingWriter]) -> bool:
    """Whether saving failed because the disk is full (torch's writer hides the OSError)."""
    errors = [e, getattr(writer, "error", None), e.__cause__, e.__context__]
    return any(isinstance(x, OSError) and x.errno == errno.ENOSPC for x in errors)


# -- what torch.load(weights_only=True) reads back -------------------------------------------
def loadable_form(obj):
    """`obj` with numpy scalars as Python numbers (a numpy.float64 lr: torch.save pickles it
    as a numpy object, which torch.load(weights_only=True) refuses) and dict subclasses
    (a defaultdict, the RNG entry of graph.state_dict()) as dicts; tensors and everything
    else are kept as they are."""
    if isinstance(obj, dict):
        kind = OrderedDict if type(obj) is OrderedDict else dict  # both load; subclasses do not
        return kind((k, loadable_form(v)) for k, v in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(loadable_form(v) for v in obj)
    if type(obj).__module__ == "numpy" and hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:
        return obj.item()
    return obj


def _check_loadable(obj, path: str) -> None:
    """Refuses (writing nothing) a value torch.load(weights_only=True) would not read back.

    The check pickles and unpickles `obj` with every tensor replaced by an empty one of its
    dtype, so it costs no tensor data.
    """
    bad = _unloadable(obj, "obj")
    if bad is not None:
        where, value, error = bad
        raise GraphcError(
            f"graphc.save: {where} is a {type(value).__module__}.{type(value).__qualname__}, which "
            f"graphc.load could not read back ({error}); nothing was written to {path!r}. Expected "
            "tensors, numbers, strings, None and lists, tuples and dicts of them. Fix: store it "
            "as one of those (e.g. a tensor or float(value)), or keep it out of the checkpoint.")


def _unloadable(obj, where: str):
    """(where, value, error) of the first value in `obj` that does not load back, or None."""
    error = _round_trip_error(obj)
    if error is None:
        return None
    children = (obj.items() if isinstance(obj, dict) else
                enumerate(obj) if type(obj) in (list, tuple) else ())
    for key, value in children:
        found = _unloadable(value, f"{where}[{key!r}]")
        if found is not None:
            return found
    return where, obj, error


def _round_trip_error(obj) -> Optional[str]:
    buffer = io.BytesIO()
    try:
        torch.save(_skeleton(obj), buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as e:
        unsupported = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if unsupported:
            return f"torch.load(weights_only=True) does not load {unsupported.group(1)}"
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


def _skeleton(obj):
    """`obj` with each plain tensor (or parameter) replaced by an empty one of its dtype."""
    if type(obj) is torch.Tensor:
        return torch.empty(0, dtype=obj.dtype)
    if type(obj) is torch.nn.Parameter:
        return torch.nn.Parameter(torch.empty(0, dtype=obj.dtype), obj.requires_grad)
    if isinstance(obj, dict):
        return {k: _skeleton(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_skeleton(v) for v in obj)
    return obj


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
