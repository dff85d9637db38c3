"""Compiled plans kept on disk, keyed by what they were compiled from (GRAPHC_PLAN_CACHE).

NOTE: Plan cache
A restart (a preempted job, a new process after a crash) compiles the same program again.
Tracing and the passes up to the stage programs are cheap and stay; lowering the plans,
the plan passes and their verification grow with the ranks a process lowers, and are what
GRAPHC_PLAN_CACHE=DIR keeps for a rank's own compile (a whole world's, `graphc plan`'s, is
not kept): one JSON file per (graph, inputs, world, lowered ranks), holding
the plans and the CompileKey they came from. The key hashes every input of the compile:
build()'s trace, the annotated graph (shapes, layouts and stages of every node: parameters
included), the stage programs, the Graph's settings, the inputs' shapes and layouts, the
world size, and the graphc sources and torch version. A file is used only when its key
equals the key of this compile in every part; one compiled from other inputs (stale) or that
cannot be read (corrupt) is ignored with a warning saying which part changed or why, and
is overwritten by the new compile. The same key's digest is what ranks compare at startup
(NOTE: Rank agreement): equal digests mean every rank compiled the same world.
Off by default: a shared file system that several jobs write is the user's choice to make.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import env
from .log import warn_user
from .plan.plan import ExecutionPlan

CACHE_FORMAT = "graphc.plan-cache/1"


@dataclass(frozen=True)
class CompileKey:
    """A compile's inputs as (part, hash) pairs; equal keys compile equal plans."""

    parts: Tuple[Tuple[str, str], ...]

    @property
    def digest(self) -> str:
        return sha("\n".join(f"{name}={h}" for name, h in self.parts))

    def changed(self, other: Dict[str, str]) -> List[str]:
        """The parts whose hash differs from `other`'s (a cached entry's)."""
        return [name for name, h in self.parts if other.get(name) != h]

    @staticmethod
    def of(texts: Dict[str, str]) -> "CompileKey":
        """Each part's text hashed; object addresses are dropped, since they differ by process."""
        return CompileKey(tuple((name, sha(without_addresses(text))) for name, text in texts.items()))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def without_addresses(text: str) -> str:
    """`text` less its object addresses (' at 0x7f..'), which differ by process."""
    return _ADDRESS.sub("", text)


def sha(text: str) -> str:
    """A short hex digest of `text` (cache keys and file names)."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@functools.lru_cache(maxsize=1)
def graphc_sources() -> str:
    """graphc's version and a hash of its source files: an editable install changes its code
    without changing its version, and a plan from other code must not be reused."""
    from . import __version__
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            h.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return f"graphc {__version__} sources {h.hexdigest()[:16]}, torch {torch.__version__}"


def cache_dir() -> Optional[str]:
    """GRAPHC_PLAN_CACHE: the folder of cached plans, or None (off)."""
    return env.read("GRAPHC_PLAN_CACHE") or None


def entry_path(folder: str, name: str, slot: str) -> str:
    """The file of one (graph, inputs, world, lowered ranks): `slot` hashes all but the graph name."""
    safe = re.sub(r"[^\w.-]", "_", name)
    return os.path.join(folder, f"{safe}-{sha(slot)[:16]}.json")


def load_plans(path: str, key: CompileKey, ranks: Sequence[int]) -> Optional[List[ExecutionPlan]]:
    """The plans cached at `path` if they were compiled from `key` for `ranks`; else None, with
    a warning when a file is there but stale or unreadable (See NOTE: Plan cache)."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            entry = json.load(f)
        if entry.get("format") != CACHE_FORMAT:
            raise ValueError(f"format {entry.get('format')!r}, expected {CACHE_FORMAT!r}")
        if entry["key"] != key.digest:
            changed = key.changed(entry.get("parts", {})) or ["the key"]
            warn_user(f"graphc plan cache: ignoring {path}: it was compiled from other inputs "
                      f"(changed: {', '.join(changed)}); compiling again and replacing it")
            return None
        plans = [ExecutionPlan.from_json(p) for p in entry["plans"]]
        if [p.rank for p in plans] != list(ranks):
            raise ValueError(f"it holds ranks {[p.rank for p in plans][:8]}, expected {list(ranks)[:8]}")
        return plans
    except Exception as e:  # noqa: BLE001 - any unreadable entry is recompiled, never used
        warn_user(f"graphc plan cache: ignoring {path}: unreadable ({type(e).__name__}: {e}); "
                  "compiling again and replacing it")
        return None


def store_plans(path: str, key: CompileKey, plans: Sequence[ExecutionPlan]) -> None:
    """Writes the entry whole or not at all (a temporary file renamed), so a reader never
    sees half of one."""
    write_entry(path, {"format": CACHE_FORMAT, "key": key.digest, "parts": dict(key.parts),
                       "plans": [p.to_json() for p in plans]})


def write_entry(path: str, entry: dict, indent: Optional[int] = None) -> None:
    """`entry` as JSON at `path`, whole or not at all (a temporary file renamed): a reader
    never sees half of one. Shared by the plan cache and the layout search's cache."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(entry, f, indent=indent)
    os.replace(tmp, path)
