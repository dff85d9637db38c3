"""A Hugging Face Llama trained on long padded sequences, the sequence split over ranks
(context parallelism), with sequence, tensor and data parallelism beside it.

    python examples/long_context.py                                    # one process
    torchrun --nproc_per_node 4 examples/long_context.py --cp 4        # ring attention
    torchrun --nproc_per_node 2 examples/long_context.py --cp 2 --method all_to_all   # Ulysses
    torchrun --nproc_per_node 4 examples/long_context.py --cp 4 --load-balance   # zig-zag chunks
    torchrun --nproc_per_node 4 examples/long_context.py --cp 2 --tp 2 --sp
    torchrun --nproc_per_node 4 examples/long_context.py --dp 2 --cp 2
    torchrun --nproc_per_node 4 examples/long_context.py --dp 2 --cp 2 --zero 2   # state / 4
    graphc check examples/long_context.py --cp 2 --nproc 2             # against eager

The model is examples/hf_llama.py's `transformers.LlamaForCausalLM` (random weights, nothing
downloaded), called as a Hugging Face loop calls it: `self.model(**batch)` on `input_ids`,
`attention_mask` (padded lines) and `labels` (-100 on padding). Parallelism lives outside
the model: every input's sequence is split over the --cp ranks (`sbp.split(1)`) and
`config.set_context_parallel(method=...)` runs attention on the split sequence (See NOTE:
Context parallel in graphc/sbp/context_parallel.py); --tp lays the projections out as
Megatron does, --sp adds sequence parallelism inside them, --dp splits the rows, --zero
shards the optimizer state (and more, by stage) over the ranks each gradient is summed over
(with --dp 2 --cp 2 all 4: See NOTE: ZeRO over joint axes in graphc/runtime/zero.py). Up to
two of --dp, --cp, --tp may exceed 1 (a 2-D mesh: rows the first of them, columns the second).
"""
import argparse
import os
import sys
import time

import torch

import graphc
from graphc import sbp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_llama  # noqa: E402 - the same model and batch format
from gpt import load_corpus  # noqa: E402

AXES = ("dp", "cp", "tp")


class Mesh:
    """The ranks as a grid of the parallel axes that exceed 1 (at most two)."""

    def __init__(self, dp: int, cp: int, tp: int):
        self.sizes = {"dp": dp, "cp": cp, "tp": tp}
        self.axes = [a for a in AXES if self.sizes[a] > 1]
        if len(self.axes) > 2:
            raise SystemExit("at most two of --dp, --cp, --tp may exceed 1 (graphc meshes are 2-D)")
        self.world = dp * cp * tp
        ranks = list(range(self.world))
        if len(self.axes) == 2:
            cols = self.sizes[self.axes[1]]
            ranks = [ranks[r:r + cols] for r in range(0, self.world, cols)]
        self.placement = graphc.placement("cpu", ranks)

    def sbp(self, **per_axis):
        """One SBP per mesh axis: per_axis[axis name], broadcast where not named."""
        found = tuple(per_axis.get(a, sbp.broadcast) for a in self.axes)
        return found if len(found) != 1 else found[0]

    def coordinate(self, rank: int, axis: str) -> int:
        """This rank's index along `axis`."""
        if axis not in self.axes:
            return 0
        if len(self.axes) == 1:
            return rank
        cols = self.sizes[self.axes[1]]
        return rank // cols if axis == self.axes[0] else rank % cols


class LongContextGraph(graphc.Graph):
    def __init__(self, model, opt, mesh: Mesh, method: str, sequence_parallel: bool,
                 load_balance: bool = False, zero: int = 0):
        super().__init__()
        self.model = model
        if mesh.world > 1:
            graphc.to_global(model, placement=mesh.placement, sbp=mesh.sbp())
            self.model.config.set_stage(0, mesh.placement)
        if mesh.sizes["tp"] > 1:
            for block in model.model.layers:
                attn, mlp = block.self_attn, block.mlp
                for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                    graphc.to_global(lin.weight, placement=mesh.placement, sbp=mesh.sbp(tp=sbp.split(0)))
                for lin in (attn.o_proj, mlp.down_proj):
                    graphc.to_global(lin.weight, placement=mesh.placement, sbp=mesh.sbp(tp=sbp.split(1)))
            self.config.enable_sequence_parallel(sequence_parallel)
        if mesh.sizes["cp"] > 1:
            self.config.set_context_parallel(method=method, load_balance=load_balance)
        if zero:
            self.config.enable_zero(True, stage=zero)
        self.add_optimizer(opt)

    def build(self, batch):
        out = self.model(**batch)
        out.loss.backward()
        return out.loss


def long_batches(ids: torch.Tensor, batch: int, seq: int, seed: int):
    """Batches of corpus windows of random lengths (seq/2 to seq tokens), padded to seq."""
    g = torch.Generator().manual_seed(seed)
    while True:
        lines = []
        for _ in range(batch):
            length = int(torch.randint(seq // 2, seq + 1, (1,), generator=g))
            start = int(torch.randint(0, len(ids) - length, (1,), generator=g))
            lines.append(ids[start:start + length])
        yield hf_llama.collate(lines, seq)


def rank_batch(mesh: Mesh, rank: int, batch):
    """This rank's component of the batch: rows over dp, the sequence over cp."""
    if mesh.world == 1:
        return batch
    layout = mesh.sbp(dp=sbp.split(0), cp=sbp.split(1))
    row, part = mesh.coordinate(rank, "dp"), mesh.coordinate(rank, "cp")

    def local(t):
        return t.chunk(mesh.sizes["dp"], 0)[row].chunk(mesh.sizes["cp"], 1)[part]
    return {k: graphc.to_global(local(v), placement=mesh.placement, sbp=layout, shape=v.shape)
            for k, v in batch.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=1, help="context-parallel ranks (the sequence split)")
    parser.add_argument("--method", default="ring", choices=["ring", "all_to_all"])
    parser.add_argument("--load-balance", action="store_true",
                        help="deal the sequence zig-zag (rank k: chunks k and 2cp-1-k) so causal work is even")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism inside --tp")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                        help="ZeRO stage over the ranks each gradient is summed over (0: off)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    mesh = Mesh(args.dp, args.cp, args.tp)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world != mesh.world:
        raise SystemExit(f"--dp {args.dp} --cp {args.cp} --tp {args.tp} needs {mesh.world} processes; "
                         f"launch with torchrun --nproc_per_node {mesh.world}")
    ids, vocab = load_corpus()
    model = hf_llama.make_model(vocab, argparse.Namespace(seed=args.seed, embd=args.embd, layers=args.layers,
                                                          heads=args.heads, block=args.seq))
    graph = LongContextGraph(model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0),
                             mesh, args.method, args.sp, args.load_balance, args.zero)
    losses = []
    for step, batch in zip(range(args.steps), long_batches(ids, args.batch, args.seq, args.seed)):
        start = time.perf_counter()
        loss = graph(rank_batch(mesh, rank, batch)).to_local()
        took = time.perf_counter() - start
        losses.append(loss.item())
        if rank == 0:
            tokens = int(batch["attention_mask"].sum())
            print(f"step {step:3d}  loss {loss.item():.4f}  {tokens / took:8.0f} tokens/s", flush=True)
    return losses


if __name__ == "__main__":
    main()
