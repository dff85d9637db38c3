"""Causal attention work per rank under context parallelism, contiguous shards against the
zig-zag dealing of `load_balance=True` (NOTE: Zig-zag dealing in graphc/sbp/layout.py).

    python benchmarks/context_parallel_balance.py --seq 64 --cp 4

Trains examples/hf_llama.py's LlamaForCausalLM (its causal-and-padding mask) for one step on
one padded sequence of --seq tokens, its sequence split over --cp ranks on the ring (the local
world: every rank a thread), and counts the attention scores each rank's ring computes,
forward and backward (query x key elements of every (query run, key run) pair it does not
skip, per batch row and head: graphc.ops.context_parallel.pair_scores counted as it runs).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import context_parallel_memory as memory  # noqa: E402 - the same model, batch and world

import graphc  # noqa: E402
from graphc.ops import context_parallel as cp_ops  # noqa: E402


def scores_per_rank(args) -> list:
    """Each rank's count of attention scores computed in one step."""
    work, right = {}, cp_ops.pair_scores

    def counted(q, kb, mask, pair, scale):
        s = right(q, kb, mask, pair, scale)
        if s is not None:
            rank = graphc.world.rank()
            work[rank] = work.get(rank, 0) + pair.q_len * pair.k_len
        return s
    cp_ops.pair_scores = counted
    try:
        memory.saved_bytes(args.cp, args)
    finally:
        cp_ops.pair_scores = right
    return [work[r] for r in sorted(work)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=64)
    args = parser.parse_args(argv)
    args.method = "ring"
    found = {}
    for balanced in (False, True):
        args.load_balance = balanced
        found[balanced] = scores_per_rank(args)
        print(f"load_balance={balanced}: scores per rank {found[balanced]}, slowest / fastest "
              f"{max(found[balanced]) / min(found[balanced]):.2f}")
    return found


if __name__ == "__main__":
    main()
