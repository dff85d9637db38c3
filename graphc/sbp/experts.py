"""The experts of a mixture-of-experts layer on every rank (`moe_experts`): the op
transformers' experts modules are traced as, and its SBP rule's target (See NOTE: Expert
parallel, graphc/ops/experts.py, for the form split over ranks)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def gated_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    """One expert (or one weight per row, batched): act(gate) * up, then down, as
    transformers' default gate (`gate_up_out.chunk(2, dim=-1)`)."""
    if gate_up.dim() == 3:   # a weight per row: [S, 2I, H] @ [S, H, 1]
        h = torch.bmm(gate_up, x.unsqueeze(-1)).squeeze(-1)
    else:
        h = F.linear(x, gate_up)
    gate, up = h.chunk(2, dim=-1)
    h = ACTIVATIONS[act](gate) * up
    return torch.bmm(down, h.unsqueeze(-1)).squeeze(-1) if down.dim() == 3 else F.linear(h, down)


def combine(pairs: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Each token's k results weighted and summed, as batched_mm: (pairs * w).view(T, k, H).sum(1)."""
    tokens, k = top_k_weights.shape
    weighted = pairs * top_k_weights.reshape(-1).unsqueeze(-1)
    return weighted.view(tokens, k, pairs.shape[-1]).sum(dim=1)


def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """Every expert on every rank: each (token, slot) pair through its expert's weights,
    looked up per pair (static shapes, so it traces on fake tensors). See NOTE: Expert parallel."""
    ids = top_k_index.reshape(-1)
    x = hidden.repeat_interleave(top_k_index.shape[-1], dim=0)
    pairs = gated_mlp(x, gate_up_proj[ids], down_proj[ids], act)
    return combine(pairs, top_k_weights).to(hidden.dtype)
