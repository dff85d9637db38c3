"""What one step of the actor runtime records and hands between its instructions."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch

from .peer_actors import RecvActor, SendActor


@dataclass
class StepStats:
    """What one step did: peak live activations per stage (micro-batches, and bytes with
    config.set_memory_stats), wall time, optional timeline."""

    max_live_activations: Dict[int, int] = field(default_factory=dict)
    max_live_bytes: Dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    compile_seconds: Dict[int, float] = field(default_factory=dict)   # NOTE: Compiled stages
    events: List[Tuple[str, float, float]] = field(default_factory=list)


@dataclass
class StepValues:
    """What one step's instructions hand each other: the actors, each (stage, micro-batch)'s
    inputs and received gradients, what each compute produced, build()'s results, and values
    being received in pieces ([tensor, elements to come])."""

    recv_actors: Dict[int, "RecvActor"]
    send_actors: Dict[int, "SendActor"]
    stats: StepStats
    values: Dict[Tuple[int, int], Dict[str, torch.Tensor]] = field(default_factory=dict)
    grads: Dict[Tuple[int, int], List[Tuple[str, torch.Tensor]]] = field(default_factory=lambda: defaultdict(list))
    produced: Dict[Tuple[int, int, str], Dict[str, torch.Tensor]] = field(default_factory=dict)
    results: Dict[str, List[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    assembling: Dict[tuple, list] = field(default_factory=dict)
    # the pre-pass's (NOTE: Whole-batch sums): values received per (stage, micro-batch), running sums per stage
    pre_received: Dict[Tuple[int, int], Dict[str, torch.Tensor]] = field(default_factory=lambda: defaultdict(dict))
    pre_sums: Dict[int, list] = field(default_factory=dict)
