"""Expert parallelism with a capacity factor: fixed-shape exchanges, drops counted.

NOTE: Expert capacity
`self.config.set_expert_capacity(factor)` gives every expert-parallel layer (See NOTE:
Expert parallel) a fixed capacity instead of dropless exchanges: per micro-batch each rank
sends every expert exactly C = ceil(factor * pairs / E) rows, pairs being this rank's
token-slot pairs (tokens * k). An expert's pairs beyond C, in the order of the tokens (then
slots), are dropped: their result is zero, so the token keeps only its other experts'
weighted results (and its residual), as GShard and Switch drop; a pair short of C is a zero
row, which the gated MLP without bias maps to zero. Every exchange then has one shape known
at compile time (E/n * C rows per member, no counts exchanged first: 2 all-to-alls forward,
2 backward), which CUDA graphs can capture and the plan lists with exact bytes. It is not
eager PyTorch when a pair is dropped; its oracle is eager with the same drops (each rank's
micro-batch's pairs, per expert the first C kept: tests/examples/test_hub_experts.py). Drops
are counted per layer and micro-batch in the routing log (NOTE: Routing log) and said once
per layer the first time they happen.
"""
from __future__ import annotations

import logging
import math
from typing import Set

import torch

from ..sbp.experts import combine, gated_mlp
from .routing_log import record_drops

_log = logging.getLogger("graphc")
_said: Set[str] = set()


def capacity_of(pairs: int, num_experts: int, factor: float) -> int:
    """Rows each rank sends each expert per micro-batch."""
    return math.ceil(factor * pairs / num_experts)


def kept_slots(ids: torch.Tensor, num_experts: int, capacity: int):
    """(pairs kept, in expert order; their slot e * C + position in the expert's buffer)."""
    order = torch.argsort(ids, stable=True)
    by_expert = ids[order]
    counts = torch.bincount(ids, minlength=num_experts)
    position = torch.arange(ids.numel(), device=ids.device) - (torch.cumsum(counts, 0) - counts)[by_expert]
    keep = position < capacity
    return order[keep], by_expert[keep] * capacity + position[keep]


def with_capacity(hidden, top_k_index, top_k_weights, gate_up, down, act, exchange, *,
                  n: int, num_experts: int, factor: float, layer: str):
    """The expert-parallel layer at a fixed capacity; `exchange(rows, sizes)` moves rows to
    the group's members (sizes per member) and its autograd back."""
    slots = top_k_index.shape[-1]
    ids = top_k_index.reshape(-1)
    cap = capacity_of(ids.numel(), num_experts, factor)
    pairs, slot = kept_slots(ids, num_experts, cap)
    _count_drops(layer, ids.numel() - pairs.numel(), ids.numel(), cap)
    width = hidden.shape[-1]
    sent = hidden.new_zeros((num_experts * cap, width)).index_copy(0, slot, hidden[pairs // slots])
    sizes = [num_experts // n * cap] * n
    rows = exchange(sent, sizes)                                           # tokens
    results = _local_experts(rows, n, cap, gate_up, down, act)
    back = exchange(results, sizes)                                        # back
    out = hidden.new_zeros((ids.numel(), down.shape[1])).index_copy(0, pairs, back[slot])
    return combine(out, top_k_weights).to(hidden.dtype)


def _local_experts(rows, n: int, cap: int, gate_up, down, act):
    """rows: from each member, its C rows for each of this rank's experts; results alike."""
    local = gate_up.shape[0]
    grid = rows.view(n, local, cap, -1)
    outs = [gated_mlp(grid[:, e].reshape(n * cap, -1), gate_up[e], down[e], act).view(n, 1, cap, -1)
            for e in range(local)]
    return torch.cat(outs, dim=1).reshape(n * local * cap, -1)


def _count_drops(layer: str, dropped: int, pairs: int, cap: int) -> None:
    record_drops(layer, dropped, pairs)
    if dropped and layer not in _said:
        _said.add(layer)
        _log.warning("expert capacity: %s dropped %d of %d token-slot pairs in a micro-batch "
                     "(capacity %d rows per expert; See NOTE: Expert capacity); said once per "
                     "layer, counted in GRAPHC_ROUTING_OUT's log", layer, dropped, pairs, cap)
