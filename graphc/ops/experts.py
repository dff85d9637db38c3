"""The experts of a mixture-of-experts layer, as stage programs call them: whole on every
rank (`moe_experts`) or split over the ranks of a mesh axis (`expert_parallel`).

NOTE: Expert parallel
Hugging Face's experts modules (Mixtral's, Qwen3-MoE's: stacked `gate_up_proj` [E, 2I, H]
and `down_proj` [E, H, I], called with hidden_states, top_k_index, top_k_weights) are
traced as one call of `moe_experts` (sbp/experts.py; passes/traced_experts.py), whatever their
`experts_implementation`: grouped_mm, batched_mm and the eager loop compute the same
function, and only a form with static shapes traces. `moe_experts` is that form (every
(token, slot) pair through its expert, as batched_mm). Its SBP rule (sbp/routing.experts)
keeps a token split, and when the stacked weights are declared split(0) on a mesh axis
(`graphc.to_global(moe.experts, placement=P, sbp=sbp.split(0))`), localize_ops gives the
call its expert-parallel form, `expert_parallel`, on each rank's tokens and experts:

  1. an all-to-all of per-expert token counts (E/n per destination rank), so every rank
     knows the split sizes it will receive: dropless, no capacity factor;
  2. an all-to-all of the token rows, sorted by expert, to the ranks holding their experts;
  3. each local expert's MLP on its rows (any count, zero included);
  4. an all-to-all of the results back, in the order they came;
  5. the weighted combine of each token's k results, as batched_mm sums them.

The backward runs the reverse exchanges of 4 and 2 (autograd of the exchange; the counts
are known). list_collectives lists the five as all_to_all Collectives per micro-batch
(3 forward, 2 backward), named by the experts' node, so the verifier pairs them on every
rank of the group and a rank without one is a GraphcError naming rank and layer.
Expert weights are read by their own rank only: their gradient is whole there, reduced
only over the mesh's other axes where they are broadcast (the data ranks holding the
same experts, as DeepSpeed-MoE).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .. import world
from ..sbp.experts import combine, gated_mlp
from .conversions import counting_shapes, my_group
from .expert_capacity import with_capacity
from .routing_log import record_routing

# the exchanges of one expert-parallel layer as plans list them, in the order they run:
# (what moves, SBP-like words before -> after); the backward reverses 4 and 2 (the counts
# are known). Read by passes/list_collectives.py.
EXCHANGES = (("counts", "counts", "counts"), ("tokens", "tokens", "experts"), ("back", "experts", "tokens"))
GRAD_EXCHANGES = (("back", "grad:tokens", "grad:experts"), ("tokens", "grad:experts", "grad:tokens"))


class _Exchange(torch.autograd.Function):
    """Rows to the ranks of a group: `send[r]` rows to member r, `recv[r]` rows from it;
    the backward sends the gradient's rows back the same way."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.sizes = (send, recv, group)
        return exchange_rows(x, send, recv, group)

    @staticmethod
    def backward(ctx, g):
        send, recv, group = ctx.sizes
        return exchange_rows(g.contiguous(), recv, send, group), None, None, None


def exchange_rows(x: torch.Tensor, send: Sequence[int], recv: Sequence[int], group) -> torch.Tensor:
    """One all-to-all of rows with per-member sizes (some may be 0)."""
    parts = [p.contiguous() for p in x.split(list(send))]
    out = [x.new_empty((r,) + tuple(x.shape[1:])) for r in recv]
    world.current().all_to_all(out, parts, group)
    return torch.cat(out)


def _exchange_counts(counts: torch.Tensor, group, n: int) -> torch.Tensor:
    """[n, E/n] per-expert counts of my rows for each member -> the members' counts for my experts."""
    return exchange_rows(counts.view(n, -1), [1] * n, [1] * n, group)


def expert_parallel(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: str = "silu", *,
                    groups: tuple, num_experts: int, layer: str = "",
                    capacity: Optional[float] = None) -> torch.Tensor:
    """The experts split over the ranks of one mesh axis (`groups`; rank k of n holds experts
    k*E/n .. (k+1)*E/n - 1): this rank's tokens exchanged to their experts' ranks and back
    (See NOTE: Expert parallel). `layer`: the experts module's name, for the routing log;
    `capacity`: set_expert_capacity's factor (None: dropless; See NOTE: Expert capacity)."""
    if counting_shapes():   # See NOTE: Shapes only (ops/conversions.py): nothing moves
        return hidden.new_zeros(hidden.shape)
    group, k, n = my_group(groups)
    if capacity is not None:
        record_routing(layer, torch.bincount(top_k_index.reshape(-1), minlength=num_experts))
        return with_capacity(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act,
                             lambda rows, sizes: _Exchange.apply(rows, sizes, sizes, group),
                             n=n, num_experts=num_experts, factor=capacity, layer=layer)
    slots = top_k_index.shape[-1]
    ids = top_k_index.reshape(-1)
    order = torch.argsort(ids, stable=True)        # pairs by expert: each rank's share adjacent
    counts = torch.bincount(ids, minlength=num_experts)
    record_routing(layer, counts)                  # NOTE: Routing log (GRAPHC_ROUTING_OUT only)
    received_counts = _exchange_counts(counts, group, n)                       # 1: counts
    send, recv = counts.view(n, -1).sum(1).tolist(), received_counts.sum(1).tolist()
    rows = _Exchange.apply(hidden[order // slots], send, recv, group)          # 2: tokens
    results = _local_experts(rows, received_counts, gate_up_proj, down_proj, act)
    back = _Exchange.apply(results, recv, send, group)                         # 4: back
    pairs = torch.empty_like(back).index_copy(0, order, back)                  # the pairs' order
    return combine(pairs, top_k_weights).to(hidden.dtype)                      # 5: combine


def _local_experts(rows: torch.Tensor, received_counts: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, act: str) -> torch.Tensor:
    """Rows from every member (each member's rows by expert) through this rank's experts;
    the results in the rows' order."""
    local = torch.arange(gate_up.shape[0], device=rows.device).repeat(received_counts.shape[0])
    expert_of_row = local.repeat_interleave(received_counts.reshape(-1))
    by_expert = torch.argsort(expert_of_row, stable=True)
    sizes: List[int] = received_counts.sum(0).tolist()
    outs = [gated_mlp(x, gate_up[e], down[e], act)
            for e, x in enumerate(rows[by_expert].split(sizes))]
    results = torch.cat(outs) if outs else rows.new_zeros((0, down.shape[1]))
    return torch.empty_like(results).index_copy(0, by_expert, results)
