"""Activation memory per rank under context parallelism (NOTE: Context parallel).

    python benchmarks/context_parallel_memory.py --seq 4096 --cp 4 [--method ring]

Trains examples/hf_llama.py's LlamaForCausalLM for one step on one padded sequence of
--seq tokens, once on one rank and once with the sequence split over --cp ranks (the local
world: every rank a thread, the same plans and programs as torchrun's), and prints the bytes
of activations each rank keeps for backward (graph.last_stats.max_live_bytes: every tensor
autograd saves, counted once by storage) and their ratio.
"""
import argparse
import os
import sys
import time

import torch

import graphc
from graphc import sbp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))


def _batch(seq: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, seq), generator=g)
    mask = (torch.arange(seq)[None] < seq - seq // 8).long()   # the last eighth is padding
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def saved_bytes(n: int, args) -> list:
    """Each rank's peak of saved activation bytes for one step on `n` ranks."""
    import hf_llama
    from gpt import Layout
    model_args = type("Args", (), dict(seed=0, embd=args.embd, layers=args.layers, heads=args.heads,
                                       block=args.seq))
    batch = _batch(args.seq, args.vocab)
    where = graphc.placement("cpu", list(range(n)))

    def make():
        model = hf_llama.make_model(args.vocab, model_args)
        graph = hf_llama.LlamaGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), Layout(1, 1, 1), 1)
        graph.model.config.set_stage(0, where)
        graph.config.set_memory_stats(True)
        if n > 1:
            graph.config.set_context_parallel(method=args.method, load_balance=getattr(args, "load_balance", False))
        return graph

    def inputs(rank, step):
        return ({k: graphc.to_global(v.chunk(n, 1)[rank], placement=where, sbp=sbp.split(1), shape=v.shape)
                 for k, v in batch.items()},)
    run = graphc.testing.local_world(make, inputs, n, steps=1)
    return [sum(g.last_stats.max_live_bytes.values()) for g in run.graphs]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--method", default="ring", choices=["ring", "all_to_all"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=64)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    whole = saved_bytes(1, args)[0]
    split = saved_bytes(args.cp, args)
    print(f"seq {args.seq}, Llama {args.layers} layers x {args.embd} ({args.heads} heads), vocab {args.vocab}, "
          f"{torch.get_default_dtype()}")
    print(f"  unsplit: {whole / 2**20:8.2f} MiB saved for backward")
    for rank, b in enumerate(split):
        print(f"  cp{args.cp} {args.method} rank {rank}: {b / 2**20:8.2f} MiB  ({b / whole:.3f}x)")
    print(f"  ({time.perf_counter() - start:.1f} s)")
    return whole, split


if __name__ == "__main__":
    main()
