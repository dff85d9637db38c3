"""Launchers for the reliability tests: torchrun, or bare processes with no supervisor.

Bare processes show what graphc itself guarantees: nothing kills the survivors of a
failed rank except graphc. Every launch has a hard timeout so a hang fails the test.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List

from helpers import free_port, require_world_marker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Exit:
    returncode: int
    output: str
    seconds: float  # from launch to exit
    ended: float = 0.0  # time.time() when the exit was seen

    def since_failure(self, text: str) -> float:
        """Seconds from the "injecting <mode> at <time>" line in `text` to this exit."""
        m = re.search(r"injecting \w+ at ([0-9.]+)", text)
        assert m, f"no failure was injected:\n{text[-3000:]}"
        return self.ended - float(m.group(1))


def env(**extra) -> dict:
    e = dict(os.environ, **{"OMP_NUM_THREADS": "1", "GRAPHC_TIMEOUT": "60", **extra})
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return e


def torchrun(script: str, args: List[str], nproc: int, timeout: float, torchrun_args=(), **extra) -> Exit:
    require_world_marker("torchrun")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), *torchrun_args, script, *args]
    start = time.monotonic()
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=timeout, env=env(**extra))
    return Exit(out.returncode, out.stdout, time.monotonic() - start, time.time())


def bare_world(script: str, args: List[str], nproc: int, timeout: float,
               wrap: Dict[int, List[str]] = None, reap_last: int = None, **extra) -> List[Exit]:
    """One process per rank with torchrun's environment variables, and no supervisor.

    wrap[rank] is a command that rank's python runs under (e.g. its own mount namespace).
    Ranks are reaped in order, reap_last after all others: until then, once dead, it is a zombie.
    """
    require_world_marker("bare_world")
    port = str(free_port())
    procs, start = [], time.monotonic()
    for rank in range(nproc):
        rank_env = env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                       LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                       **extra)
        procs.append(subprocess.Popen([*(wrap or {}).get(rank, []), sys.executable, script, *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=rank_env))
    exits = {}
    order = sorted(range(nproc), key=lambda r: r == reap_last)
    try:
        for rank in order:
            left = max(1.0, timeout - (time.monotonic() - start))
            out, _ = procs[rank].communicate(timeout=left)
            exits[rank] = Exit(procs[rank].returncode, out, time.monotonic() - start, time.time())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [exits[r] for r in range(nproc)]
