"""A character-level GPT, trained with pipeline x tensor x data parallelism on CPU ranks.

    python examples/gpt.py                                   # one process
    torchrun --nproc_per_node 2 examples/gpt.py --pp 2       # pipeline of 2
    torchrun --nproc_per_node 2 examples/gpt.py --tp 2       # Megatron tensor parallel
    torchrun --nproc_per_node 8 examples/gpt.py --pp 2 --tp 2 --dp 2
    torchrun --nproc_per_node 2 examples/gpt.py --dp 2 --zero 2   # ZeRO: sharded optimizer state
    torchrun --nproc_per_node 4 examples/gpt.py --pp 2 --dp 2 --zero 3   # + parameters sharded between uses
    torchrun --nproc_per_node 8 examples/gpt.py --pp 2 --tp 2 --dp 2 --amp bf16   # mixed precision

The model is written as a GPT's author writes it, and graphc compiles it unchanged:
`b, t = idx.size()` and a shape assert, positions from `torch.arange(t)`, a causal
mask, and the token embedding tied to the LM head (`wte.weight = lm_head.weight`),
which with --pp puts one weight on the first and the last stage. Parallelism lives
outside the model: set_stage per block (--pp), parameter layouts (--tp: q/k/v and the
MLP's first layer split by output, the projections by input, the tied embedding by
vocabulary) and a batch split over --dp ranks. Prints the loss and tokens/s per step.
"""
import argparse
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "corpus.txt")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 32
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_embd = cfg.n_head, cfg.n_embd
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        b, t, c = x.size()
        hd = c // self.n_head
        q = self.q(x).view(b, t, self.n_head, hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.n_head, hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.n_head, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.n_embd), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
            wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.n_embd)))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx):
        b, t = idx.size()
        assert t <= self.config.block_size, f"sequence of length {t} > block size {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# -- parallelism, outside the model ---------------------------------------------------------
@dataclass
class Layout:
    pp: int = 1
    tp: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp

    def ranks(self, stage: int):
        """Stage s's ranks: a dp x tp grid (rows: data-parallel replicas, columns: tensor shards)."""
        first = stage * self.dp * self.tp
        grid = [[first + d * self.tp + t for t in range(self.tp)] for d in range(self.dp)]
        if self.dp > 1 and self.tp > 1:
            return grid
        return [r for row in grid for r in row]

    def placement(self, stage: int):
        return graphc.placement("cpu", ranks=self.ranks(stage))

    def param_sbp(self, split_dim):
        """A parameter's SBP: split(split_dim) over the tensor-parallel ranks (None: replicated)."""
        tp = graphc.sbp.split(split_dim) if split_dim is not None and self.tp > 1 else graphc.sbp.broadcast
        if self.dp > 1 and self.tp > 1:
            return (graphc.sbp.broadcast, tp)
        return tp

    def batch_sbp(self):
        """Inputs: rows split over the data-parallel ranks, whole on each tensor-parallel rank."""
        dp = graphc.sbp.split(0) if self.dp > 1 else graphc.sbp.broadcast
        if self.dp > 1 and self.tp > 1:
            return (dp, graphc.sbp.broadcast)
        return dp


def tensor_parallel(model: GPT, layout: Layout, stage_of_block) -> None:
    """Megatron's layout: q/k/v and fc split by output rows, the projections by input columns."""
    def declare(param, split_dim, stage):
        graphc.to_global(param, placement=layout.placement(stage), sbp=layout.param_sbp(split_dim))

    for i, block in enumerate(model.transformer.h):
        s = stage_of_block(i)
        for lin in (block.attn.q, block.attn.k, block.attn.v, block.mlp.fc):
            declare(lin.weight, 0, s)
            declare(lin.bias, 0, s)
        for lin in (block.attn.proj, block.mlp.proj):
            declare(lin.weight, 1, s)
    declare(model.lm_head.weight, 0, layout.pp - 1)  # vocabulary-parallel, tied to wte


class GPTGraph(graphc.Graph):
    def __init__(self, model: GPT, optimizer, layout: Layout, accumulation: int = 2,
                 schedule: str = "1f1b", zero: int = 0, amp: str = "", reduce_dtype: str = "fp32"):
        super().__init__()
        self.model = model
        n = model.config.n_layer
        stage_of_block = (lambda i: i * layout.pp // n)
        if layout.pp > 1:  # self.model gives graphc's view of each module, with its .config
            blocks = self.model.transformer
            blocks.wte.config.set_stage(0, layout.placement(0))
            blocks.wpe.config.set_stage(0, layout.placement(0))
            for i in range(n):
                blocks.h[i].config.set_stage(stage_of_block(i), layout.placement(stage_of_block(i)))
            last = layout.pp - 1
            blocks.ln_f.config.set_stage(last, layout.placement(last))
            self.model.lm_head.config.set_stage(last, layout.placement(last))
        if layout.tp > 1:
            tensor_parallel(model, layout, stage_of_block)
        self.config.set_gradient_accumulation_steps(accumulation)
        self.config.set_pipeline_schedule(schedule)
        if zero:  # optimizer state (2: + gradient buckets, 3: + parameters) split over the --dp ranks
            self.config.enable_zero(True, stage=zero)
        if amp:   # build() under autocast; float32 master weights, gradients and reductions
            self.config.enable_amp(True, dtype=DTYPES[amp])
            if amp == "fp16":
                self.set_grad_scaler(graphc.amp.GradScaler(init_scale=2.0 ** 16))
        self.config.set_grad_reduce_dtype(DTYPES[reduce_dtype])
        self.add_optimizer(optimizer)

    def build(self, idx, targets):
        loss = lm_loss(self.model(idx), targets)
        loss.backward()
        return loss


def global_inputs(layout: Layout, rank: int, idx, targets):
    """This rank's part of the batch, as global tensors (the whole batch without --dp)."""
    if layout.world == 1 or layout.dp == 1:
        return idx, targets
    row = (rank % (layout.dp * layout.tp)) // layout.tp
    first, last = layout.placement(0), layout.placement(layout.pp - 1)
    sbp = layout.batch_sbp()
    return (graphc.to_global(idx.chunk(layout.dp)[row], placement=first, sbp=sbp),
            graphc.to_global(targets.chunk(layout.dp)[row], placement=last, sbp=sbp))


# -- data -------------------------------------------------------------------------------------
def load_corpus():
    text = open(CORPUS, encoding="utf-8").read()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    return ids, len(chars)


def batches(ids, batch: int, block: int, steps: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - block - 1, (batch,), generator=g)
        x = torch.stack([ids[s:s + block] for s in starts.tolist()])
        y = torch.stack([ids[s + 1:s + block + 1] for s in starts.tolist()])
        yield x, y


def make_model(vocab: int, args) -> GPT:
    torch.manual_seed(args.seed)
    return GPT(GPTConfig(vocab_size=vocab, block_size=args.block, n_layer=args.layers,
                         n_head=args.heads, n_embd=args.embd))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                        help="ZeRO stage over the --dp ranks (0: replicated)")
    parser.add_argument("--amp", default="", choices=("", "bf16", "fp16"),
                        help="mixed precision: build() under autocast to this dtype")
    parser.add_argument("--reduce-dtype", default="fp32", choices=tuple(DTYPES),
                        help="the dtype data-parallel gradients are all-reduced in")
    parser.add_argument("--compile-stages", action="store_true",
                        help="compile each stage program with Inductor (config.set_compile_stages)")
    args = parser.parse_args(argv)

    layout = Layout(args.pp, args.tp, args.dp)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world != layout.world:
        raise SystemExit(f"--pp {args.pp} --tp {args.tp} --dp {args.dp} needs {layout.world} "
                         f"processes; launch with torchrun --nproc_per_node {layout.world}")
    ids, vocab = load_corpus()
    model = make_model(vocab, args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    graph = GPTGraph(model, opt, layout, args.accumulation, args.schedule, args.zero, args.amp,
                     args.reduce_dtype)
    graph.config.set_compile_stages(args.compile_stages)
    losses = []
    for step, (x, y) in enumerate(batches(ids, args.batch, args.block, args.steps, args.seed)):
        start = time.perf_counter()
        loss = graph(*global_inputs(layout, rank, x, y)).to_local()
        took = time.perf_counter() - start
        if loss.numel():
            losses.append(loss.item())
            if rank == world - 1:
                print(f"step {step:3d}  loss {loss.item():.4f}  {x.numel() / took:8.0f} tokens/s",
                      flush=True)
    if losses and rank == world - 1:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps "
              f"(uniform guess: {math.log(vocab):.3f})")
    return losses


if __name__ == "__main__":
    main()
