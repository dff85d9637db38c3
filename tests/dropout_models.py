"""A one-block transformer with dropout where tensor parallelism puts it on replicas and on
shards, for the replica-equal randomness tests (NOTE: Replica-equal randomness)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp


class DropAttention(nn.Module):
    """Heads from separate q/k/v; dropout on the head-split v and inside attention; dropout on
    the output projection, which a row-parallel c_proj leaves broadcast after its all-reduce."""

    def __init__(self, c: int, heads: int, p: float):
        super().__init__()
        self.n_head, self.p = heads, p
        self.q, self.k, self.v, self.c_proj = (nn.Linear(c, c) for _ in range(4))
        self.drop = nn.Dropout(p)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (lin(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        v = F.dropout(v, self.p, self.training)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0,
                                           is_causal=True)
        return self.drop(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class DropNet(nn.Module):
    """x [B, T, d_in] -> logits [B, T, classes]; the residual stream itself is dropped too."""

    def __init__(self, p: float, c: int = 8, heads: int = 4, d_in: int = 6, classes: int = 5):
        super().__init__()
        self.inp, self.ln = nn.Linear(d_in, c), nn.LayerNorm(c)
        self.attn, self.res_drop = DropAttention(c, heads, p), nn.Dropout(p)
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        x = self.inp(x)
        x = self.res_drop(x + self.attn(self.ln(x)))
        return self.head(x)


def tensor_parallel(model: DropNet, where) -> DropNet:
    """Megatron's layout: q/k/v column-parallel (heads split), c_proj row-parallel."""
    graphc.to_global(model, placement=where, sbp=sbp.broadcast)
    for lin in (model.attn.q, model.attn.k, model.attn.v):
        graphc.to_global(lin, placement=where, sbp=sbp.split(0))
    graphc.to_global(model.attn.c_proj.weight, placement=where, sbp=sbp.split(1))
    return model
