"""A Hugging Face Llama, as transformers builds it, trained from a dict DataLoader with
pipeline x tensor x data parallelism on CPU ranks.

    python examples/hf_llama.py                                   # one process
    torchrun --nproc_per_node 2 examples/hf_llama.py --pp 2       # pipeline of 2
    torchrun --nproc_per_node 2 examples/hf_llama.py --dp 2       # data parallel
    torchrun --nproc_per_node 2 examples/hf_llama.py --tp 2       # Megatron tensor parallel
    torchrun --nproc_per_node 8 examples/hf_llama.py --pp 2 --tp 2 --dp 2

The model is `transformers.LlamaForCausalLM` (a small config, random weights: nothing is
downloaded), called the way a Hugging Face training loop calls it: `build(self, batch)` with
`self.model(**batch)`, where the batch is the DataLoader's dict of `input_ids`,
`attention_mask` (lines of different lengths, padded) and `labels` (-100 on padding), and
the model computes its own loss. Parallelism lives outside the model: set_stage on
decoder layers (--pp), Megatron layouts on the attention and MLP projections (--tp), and
each rank's rows of the batch (--dp). Prints the loss and tokens/s per step.
"""
import argparse
import math
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils._pytree import tree_map

import graphc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import Layout, load_corpus  # noqa: E402 - the same corpus and rank grid as the GPT


class Lines(Dataset):
    """Character ids of the corpus's lines, cut to at most `block` tokens."""

    def __init__(self, ids, newline: int, block: int):
        cuts = [0] + [i + 1 for i, t in enumerate(ids.tolist()) if t == newline]
        self.lines = [ids[a:b][:block] for a, b in zip(cuts, cuts[1:]) if b - a > 2]

    def __len__(self):
        return len(self.lines)

    def __getitem__(self, i):
        return self.lines[i]


def collate(lines, block: int):
    """A Hugging Face-style batch: padded ids, the attention mask, labels -100 on padding."""
    ids = torch.zeros(len(lines), block, dtype=torch.long)
    mask = torch.zeros(len(lines), block, dtype=torch.long)
    for r, line in enumerate(lines):
        ids[r, :len(line)] = line
        mask[r, :len(line)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def make_model(vocab: int, args):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=args.embd, intermediate_size=2 * args.embd,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.block,
                      use_cache=False)
    return LlamaForCausalLM(cfg)


class LlamaGraph(graphc.Graph):
    def __init__(self, model, opt, layout: Layout, accumulation: int):
        super().__init__()
        self.model = model
        n = model.config.num_hidden_layers
        stage_of = (lambda i: i * layout.pp // n)
        if layout.pp > 1:  # self.model gives graphc's view of each module, with its .config
            body = self.model.model
            body.embed_tokens.config.set_stage(0, layout.placement(0))
            for i in range(n):
                body.layers[i].config.set_stage(stage_of(i), layout.placement(stage_of(i)))
            last = layout.pp - 1
            body.norm.config.set_stage(last, layout.placement(last))
            self.model.lm_head.config.set_stage(last, layout.placement(last))
        if layout.tp > 1:
            for i, block in enumerate(model.model.layers):
                where = layout.placement(stage_of(i))
                graphc.to_global(block, placement=where, sbp=layout.param_sbp(None))
                attn, mlp = block.self_attn, block.mlp
                for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                    graphc.to_global(lin.weight, placement=where, sbp=layout.param_sbp(0))
                for lin in (attn.o_proj, mlp.down_proj):
                    graphc.to_global(lin.weight, placement=where, sbp=layout.param_sbp(1))
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(opt)

    def build(self, batch):
        out = self.model(**batch)
        out.loss.backward()
        return out.loss


def rank_batch(layout: Layout, rank: int, batch):
    """This rank's rows of the batch, as global tensors (the whole batch without --dp)."""
    if layout.dp == 1:
        return batch
    row = (rank % (layout.dp * layout.tp)) // layout.tp
    first = layout.placement(0)
    return tree_map(lambda t: graphc.to_global(t.chunk(layout.dp)[row], placement=first,
                                               sbp=layout.batch_sbp()), batch)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=48)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    layout = Layout(args.pp, args.tp, args.dp)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world != layout.world:
        raise SystemExit(f"--pp {args.pp} --tp {args.tp} --dp {args.dp} needs {layout.world} "
                         f"processes; launch with torchrun --nproc_per_node {layout.world}")
    ids, vocab = load_corpus()
    newline = _newline_id()
    model = make_model(vocab, args)
    graph = LlamaGraph(model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0),
                       layout, args.accumulation)
    g = torch.Generator().manual_seed(args.seed)  # every rank draws the same batches
    loader = DataLoader(Lines(ids, newline, args.block), batch_size=args.batch, shuffle=True,
                        generator=g, drop_last=True, collate_fn=lambda b: collate(b, args.block))
    losses = []
    for step, batch in zip(range(args.steps), _epochs(loader)):
        start = time.perf_counter()
        loss = graph(rank_batch(layout, rank, batch)).to_local()
        took = time.perf_counter() - start
        tokens = int(batch["attention_mask"].sum())
        if loss.numel():
            losses.append(loss.item())
            if rank == world - 1:
                print(f"step {step:3d}  loss {loss.item():.4f}  {tokens / took:8.0f} tokens/s", flush=True)
    if losses and rank == world - 1:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps "
              f"(uniform guess: {math.log(vocab):.3f})")
    return losses


def _epochs(loader):
    while True:
        yield from loader


def _newline_id() -> int:
    from gpt import CORPUS
    chars = sorted(set(open(CORPUS, encoding="utf-8").read()))
    return chars.index("\n")


if __name__ == "__main__":
    main()
