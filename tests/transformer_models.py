"""Small transformer models for the boundary and tied-parameter tests.

`BlockNet` is one pre-norm transformer block (LayerNorm, causal attention, residuals, MLP)
between an input projection and a head; `LEAVES` lists its sub-modules in forward order,
so a test can cut it into two stages at any position. `TinyGPT` has a token embedding
tied to its LM head (`self.lm_head.weight = self.wte.weight`); `SharedNet` calls one
Linear on two stages.
"""
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc


class Attention(nn.Module):
    """Causal self-attention written with plain ops (or F.scaled_dot_product_attention)."""

    def __init__(self, d: int, heads: int, t: int, sdpa: bool = False):
        super().__init__()
        self.q, self.k, self.v, self.proj = (nn.Linear(d, d) for _ in range(4))
        self.heads, self.scale, self.sdpa = heads, (d // heads) ** -0.5, sdpa
        self.register_buffer("causal", torch.ones(t, t, dtype=torch.bool).tril())

    def _heads(self, x):  # (b, t, d) -> (b, heads, t, d / heads): a non-contiguous view
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def forward(self, x):
        q, k, v = self._heads(self.q(x)), self._heads(self.k(x)), self._heads(self.v(x))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * self.scale
            y = att.masked_fill(~self.causal, float("-inf")).softmax(-1) @ v
        return self.proj(y.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, d: int, heads: int, t: int, sdpa: bool = False):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, heads, t, sdpa)
        self.ln2, self.mlp = nn.LayerNorm(d), MLP(d)

    def forward(self, h):
        h = h + self.attn(self.ln1(h))
        return h + self.mlp(self.ln2(h))


class BlockNet(nn.Module):
    """x (b, t, d_in) -> logits (b, t, classes) through one transformer block."""

    LEAVES = ("inp", "block.ln1", "block.attn.q", "block.attn.k", "block.attn.v",
              "block.attn.proj", "block.ln2", "block.mlp.fc1", "block.mlp.fc2", "ln_f", "head")

    def __init__(self, d_in: int = 6, d: int = 8, heads: int = 2, t: int = 4, classes: int = 5,
                 sdpa: bool = False):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.block = TransformerBlock(d, heads, t, sdpa)
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.ln_f(self.block(self.inp(x))))


class CutGraph(graphc.Graph):
    """BlockNet cut before each leaf index in `cuts`: with cuts (3,), LEAVES[:3] run on
    stage 0 (rank 0) and LEAVES[3:] on stage 1 (rank 1); with (3, 7) three stages."""

    def __init__(self, model: BlockNet, opt, cuts: Sequence[int], accumulation: int = 2):
        super().__init__()
        self.model = model
        for i, path in enumerate(BlockNet.LEAVES):
            stage = sum(i >= c for c in cuts)
            _block(self.model, path).config.set_stage(stage, graphc.placement("cpu", ranks=[stage]))
        self.config.set_gradient_accumulation_steps(accumulation)
        if opt is not None:
            self.add_optimizer(opt)

    def build(self, x, y):
        loss = token_loss(self.model(x), y)
        loss.backward()
        return loss


def _block(block, path: str):
    """The ModuleBlock at a dotted path (attribute access on Graph-wrapped modules)."""
    for part in path.split("."):
        block = getattr(block, part)
    return block


def token_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def block_batches(n: int = 2, batch: int = 4, t: int = 4, d_in: int = 6, classes: int = 5, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, t, d_in, generator=g), torch.randint(0, classes, (batch, t), generator=g))
            for _ in range(n)]


class TinyGPT(nn.Module):
    """Token + position embeddings, `layers` blocks, final LayerNorm, LM head tied to wte."""

    def __init__(self, vocab: int = 16, d: int = 8, heads: int = 2, t: int = 4, layers: int = 2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.register_buffer("pos", torch.arange(t), persistent=False)
        self.blocks = nn.ModuleList(TransformerBlock(d, heads, t) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2 does

    def forward(self, idx):
        h = self.wte(idx) + self.wpe(self.pos)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))


class GPTGraph(graphc.Graph):
    """TinyGPT on `stages` placements: the embeddings with blocks[0] on the first, the final
    LayerNorm and the (tied) LM head with the last block on the last, blocks spread evenly."""

    def __init__(self, model: TinyGPT, opt, stages: Sequence = (), accumulation: int = 2,
                 schedule: str = "1f1b"):
        super().__init__()
        self.model = model
        if stages:
            p, layers = len(stages), len(model.blocks)
            self.model.wte.config.set_stage(0, stages[0])
            self.model.wpe.config.set_stage(0, stages[0])
            for i in range(layers):
                self.model.blocks[i].config.set_stage(i * p // layers, stages[i * p // layers])
            self.model.ln_f.config.set_stage(p - 1, stages[-1])
            self.model.lm_head.config.set_stage(p - 1, stages[-1])
        self.config.set_gradient_accumulation_steps(accumulation)
        self.config.set_pipeline_schedule(schedule)
        if opt is not None:
            self.add_optimizer(opt)

    def build(self, idx, targets):
        loss = token_loss(self.model(idx), targets)
        loss.backward()
        return loss


def token_batches(n: int = 3, batch: int = 8, t: int = 4, vocab: int = 16, seed: int = 4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, t), generator=g), torch.randint(0, vocab, (batch, t), generator=g))
            for _ in range(n)]


class Stage(nn.Module):
    """A stage of SharedNet: the shared Linear, then its own."""

    def __init__(self, shared: nn.Linear):
        super().__init__()
        self.shared, self.fc = shared, nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(F.gelu(self.shared(x)))


class SharedNet(nn.Module):
    """One Linear called by two stages (it has three names in the state dict)."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.s0, self.s1 = Stage(self.shared), Stage(self.shared)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.s1(self.s0(x)))


class SharedGraph(graphc.Graph):
    """SharedNet with s0 on stage 0 (rank 0), s1 and the head on stage 1 (rank 1)."""

    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.model.s0.config.set_stage(0, graphc.placement("cpu", ranks=[0]))
        self.model.s1.config.set_stage(1, graphc.placement("cpu", ranks=[1]))
        self.config.set_gradient_accumulation_steps(2)
        if opt is not None:
            self.add_optimizer(opt)

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss
