"""nanoGPT-style transformer blocks for the tensor-parallel attention tests.

Written the way public GPTs write them: `B, T, C = x.size()`, a fused `c_attn` cut with
`.split(C, dim=2)` (or separate q/k/v Linears), heads by `view(B, T, H, hd).transpose(1, 2)`
and back by `transpose(1, 2).contiguous().view(B, T, C)`, causal attention either through
`F.scaled_dot_product_attention(is_causal=True)` (or an explicit attn_mask) or by hand
(minGPT: a `tril` buffer sliced to T, `masked_fill`, softmax in float32 then `type_as`).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp

ATTENTION = ("sdpa", "sdpa_mask", "manual")


class CausalSelfAttention(nn.Module):
    def __init__(self, c: int, heads: int, block: int, fused: bool = True, kind: str = "sdpa"):
        super().__init__()
        self.fused, self.kind, self.n_head, self.n_embd = fused, kind, heads, c
        if fused:
            self.c_attn = nn.Linear(c, 3 * c)
        else:
            self.q, self.k, self.v = nn.Linear(c, c), nn.Linear(c, c), nn.Linear(c, c)
        self.c_proj = nn.Linear(c, c)
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x):
        B, T, C = x.size()
        if self.fused:
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.kind == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        elif self.kind == "sdpa_mask":
            mask = self.bias[:, :, :T, :T] > 0
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att.float(), dim=-1).type_as(q)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, c: int, heads: int, block: int, fused: bool = True, kind: str = "sdpa"):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(c), CausalSelfAttention(c, heads, block, fused, kind)
        self.ln_2, self.mlp = nn.LayerNorm(c), MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class BlockStack(nn.Module):
    """x [B, T, d_in] -> logits [B, T, classes] through `layers` blocks."""

    def __init__(self, layers: int = 2, c: int = 16, heads: int = 4, block: int = 8, d_in: int = 8,
                 classes: int = 5, fused: bool = True, kind: str = "sdpa"):
        super().__init__()
        self.inp = nn.Linear(d_in, c)
        self.blocks = nn.ModuleList([Block(c, heads, block, fused, kind) for _ in range(layers)])
        self.ln_f, self.head = nn.LayerNorm(c), nn.Linear(c, classes)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def megatron(model: BlockStack, where) -> BlockStack:
    """Megatron's layout: q/k/v (or the fused c_attn) and c_fc column-parallel, both c_proj
    row-parallel, everything else replicated."""
    graphc.to_global(model, placement=where, sbp=sbp.broadcast)
    for block in model.blocks:
        attn = block.attn
        for lin in ([attn.c_attn] if attn.fused else [attn.q, attn.k, attn.v]):
            graphc.to_global(lin, placement=where, sbp=sbp.split(0))
        graphc.to_global(block.mlp.c_fc, placement=where, sbp=sbp.split(0))
        graphc.to_global(attn.c_proj.weight, placement=where, sbp=sbp.split(1))
        graphc.to_global(block.mlp.c_proj.weight, placement=where, sbp=sbp.split(1))
    return model


class TokenLossGraph(graphc.Graph):
    """Per-token cross entropy over [B, T] targets, as GPTs compute it."""

    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.add_optimizer(opt)

    def build(self, x, y):
        logits = self.model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        return loss


def token_loss(logits, y):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
