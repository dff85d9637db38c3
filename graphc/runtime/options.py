"""What the runtime reads of a Graph's settings, as one value: `graph.config.run_options()`.

The runtime is built from values (docs/design.md: Layers): it never holds the Graph or its
config object, so it can be read, and started in a test, without either.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RunOptions:
    """The settings a rank's start reads: its runtime, its tracer and its agreement."""

    graph_name: str                      # the user's Graph class, named in refusals
    gradient_accumulation_steps: int     # agreed between ranks (NOTE: Rank agreement)
    pipeline_schedule: str               # agreed between ranks
    recv_window: int = 2                 # receives each receive actor keeps posted
    trace_path: Optional[str] = None     # config.set_trace: the merged trace's file
    trace_steps: int = 5                 # ... for this many steps
    cuda_graphs: bool = False            # NOTE: CUDA graphs
    memory_stats: bool = False           # StepStats.max_live_bytes
    compile_stages: bool = False         # NOTE: Compiled stages
