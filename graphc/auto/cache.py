"""Searched layouts kept on disk, keyed by the model and the cluster (NOTE: Search cache).

NOTE: Search cache
A layout search compiles and simulates several candidates (seconds to a minute); a job that
restarts, or trains the same model again, asks the same question. The answer is kept as one
JSON file per question in the cache folder (enable_auto_parallel's `cache`, else
GRAPHC_AUTO_CACHE, else ~/.cache/graphc/auto), named by the digest of its key:
  * the model: its class and module tree (repr), every parameter's name, shape, dtype and
    whether it trains, the Graph's options the search keeps (its constraints: stages
    declared), the optimizer's class;
  * the inputs: each one's shape, dtype and whether it splits over data-parallel ranks;
  * the cluster: the world size, the device preset's numbers, the memory per rank;
  * the search: how many candidates it compiles, and graphc's sources (other code may
    choose otherwise).
A file whose key differs in any part, or that cannot be read, is searched again and
replaced (rank 0 alone reads and writes it; the other ranks receive its layout).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Optional, Sequence

from .layout import Layout

CACHE_FORMAT = "graphc.auto-cache/1"


def cache_folder(folder: Optional[str]) -> str:
    """The folder asked for, else GRAPHC_AUTO_CACHE, else ~/.cache/graphc/auto."""
    from .. import env
    return folder or env.read("GRAPHC_AUTO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "graphc", "auto")


def search_key(spec, inputs: Sequence, nproc: int, batched: Sequence[bool], optimizer,
               device_numbers: str, memory: int, top: int) -> dict:
    """The question a search answers, part by part (See NOTE: Search cache)."""
    from ..plan_cache import graphc_sources, sha, without_addresses
    params = [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in spec.root.named_parameters()]
    stages = sorted({m.stage_id for m in spec.modules.values() if m.stage_id is not None})
    return {
        "model": sha(without_addresses(repr(spec.root)) + repr(params)),
        "options": sha(repr((len(stages), spec.amp_dtype, spec.param_dtype, spec.whole_inputs))),
        "optimizer": type(optimizer).__name__ if optimizer is not None else "none",
        "inputs": repr([(tuple(getattr(t, "shape", ())), str(getattr(t, "dtype", type(t).__name__)), b)
                        for t, b in zip(inputs, batched)]),
        "cluster": f"{nproc} ranks of {device_numbers}, {memory} bytes each",
        "search": f"top {top}; {graphc_sources()}",
    }


def entry_path(folder: str, name: str, key: dict) -> str:
    from ..plan_cache import sha
    return os.path.join(folder, f"{name}-{sha(json.dumps(key, sort_keys=True))[:16]}.json")


def load_layout(path: str, key: dict) -> Optional[Layout]:
    """The cached layout at `path` if it answers `key`; else None (searched again)."""
    try:
        with open(path) as f:
            entry = json.load(f)
        if entry.get("format") != CACHE_FORMAT or entry.get("key") != key:
            return None
        return Layout(**dict(entry["layout"], boundaries=tuple(entry["layout"]["boundaries"])))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def store_layout(path: str, key: dict, layout: Layout, report: str) -> None:
    """Writes the entry whole or not at all (plan_cache.write_entry)."""
    from ..plan_cache import write_entry
    write_entry(path, {"format": CACHE_FORMAT, "key": key, "layout": asdict(layout), "report": report}, indent=1)
