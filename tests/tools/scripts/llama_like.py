"""A small Llama-like transformer (RMSNorm with a float32 cast, RoPE from non-persistent
buffers, grouped-query attention by repeat_kv, SwiGLU) on pipeline --pp x data --dp, for
`graphc plan`:

    graphc plan tests/tools/scripts/llama_like.py --nproc 4 --out plans --simulate
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc

VOCAB, DIM, HEADS, KV_HEADS, LAYERS, SEQ, BATCH = 32, 32, 4, 2, 4, 8, 8


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = 1e-6

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def repeat_kv(x, n):
    b, kv, t, hd = x.shape
    return x[:, :, None].expand(b, kv, n, t, hd).reshape(b, kv * n, t, hd)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        hd = DIM // HEADS
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.k = nn.Linear(DIM, KV_HEADS * hd, bias=False)
        self.v = nn.Linear(DIM, KV_HEADS * hd, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.outer(torch.arange(SEQ).float(), inv)
        angles = torch.cat((angles, angles), -1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        hd = DIM // HEADS
        q = self.q(x).view(b, t, HEADS, hd).transpose(1, 2)
        k = self.k(x).view(b, t, KV_HEADS, hd).transpose(1, 2)
        v = self.v(x).view(b, t, KV_HEADS, hd).transpose(1, 2)
        cos, sin = self.cos[:t], self.sin[:t]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, HEADS // KV_HEADS), repeat_kv(v, HEADS // KV_HEADS)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, DIM))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm = RMSNorm(DIM), Attention(), RMSNorm(DIM)
        self.gate = nn.Linear(DIM, 2 * DIM, bias=False)
        self.up = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
        self.norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        h = self.embed(idx)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class Train(graphc.Graph):
    def __init__(self, model, opt, pp, where):
        super().__init__()
        self.model = model
        if pp > 1:
            self.model.embed.config.set_stage(0, where(0))
            for i in range(LAYERS):
                self.model.layers[i].config.set_stage(i * pp // LAYERS, where(i * pp // LAYERS))
            self.model.norm.config.set_stage(pp - 1, where(pp - 1))
            self.model.head.config.set_stage(pp - 1, where(pp - 1))
        self.config.set_gradient_accumulation_steps(2)
        self.add_optimizer(opt)

    def build(self, idx, targets):
        loss = F.cross_entropy(self.model(idx).flatten(0, 1), targets.flatten())
        loss.backward()
        return loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    args = parser.parse_args()

    def where(stage):
        return graphc.placement("cpu", ranks=list(range(stage * args.dp, (stage + 1) * args.dp)))

    torch.manual_seed(0)
    model = Llama()
    graph = Train(model, torch.optim.AdamW(model.parameters()), args.pp, where)
    idx = torch.randint(0, VOCAB, (BATCH // args.dp, SEQ))
    targets = torch.randint(0, VOCAB, (BATCH // args.dp, SEQ))
    rows = graphc.sbp.split(0) if args.dp > 1 else graphc.sbp.broadcast
    graph(graphc.to_global(idx, placement=where(0), sbp=rows),
          graphc.to_global(targets, placement=where(args.pp - 1), sbp=rows))


if __name__ == "__main__":
    main()
