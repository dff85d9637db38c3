"""A Hugging Face Mixtral (mixture of experts), as transformers builds it, trained with
expert x data x pipeline parallelism on CPU ranks.

    python examples/moe.py                                        # one process
    torchrun --nproc_per_node 2 examples/moe.py --ep 2            # experts over the data ranks
    torchrun --nproc_per_node 4 examples/moe.py --dp 2 --ep 2     # data 2 x expert 2
    torchrun --nproc_per_node 8 examples/moe.py --pp 2 --dp 2 --ep 2
    graphc check examples/moe.py --nproc 8 -- --pp 2 --dp 2 --ep 2
    torchrun --nproc_per_node 4 examples/moe.py --dp 2 --ep 2 --aux-loss 0.01   # + router aux loss
    graphc check examples/moe.py --nproc 8 -- --pp 2 --dp 2 --ep 2 --aux-loss 0.01 --aux-float64

The model is `transformers.MixtralForCausalLM` (a small config, random weights: nothing is
downloaded), on its own loss (`labels=`). Parallelism lives outside the model: set_stage on
decoder layers (--pp); on each stage a grid of dp x ep ranks, the batch split over all of
them, each layer's experts split(0) over the ep ranks of a row (`graphc.to_global(
layer.mlp.experts, ...)`), so a rank holds 1/ep of the experts and exchanges tokens with its
row (docs/sbp.md: Expert parallelism); non-expert weights are replicated everywhere. Prints
the loss per step.
"""
import argparse
import os
from dataclasses import dataclass

import torch

import graphc


@dataclass
class Layout:
    pp: int = 1
    dp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.ep

    def ranks(self, stage: int):
        """Stage s's ranks: a dp x ep grid (rows: data replicas of the experts, columns: expert shards)."""
        first = stage * self.dp * self.ep
        grid = [[first + d * self.ep + e for e in range(self.ep)] for d in range(self.dp)]
        return grid if self.dp > 1 and self.ep > 1 else [r for row in grid for r in row]

    def placement(self, stage: int):
        return graphc.placement("cpu", ranks=self.ranks(stage))

    def two_axes(self) -> bool:
        return self.dp > 1 and self.ep > 1

    def experts_sbp(self):
        """split(0) over the expert axis, broadcast over the data axis."""
        ep = graphc.sbp.split(0) if self.ep > 1 else graphc.sbp.broadcast
        return (graphc.sbp.broadcast, ep) if self.two_axes() else ep

    def batch_sbp(self):
        """Rows split over every rank of a stage (data and expert axes alike)."""
        split = graphc.sbp.split(0) if self.dp * self.ep > 1 else graphc.sbp.broadcast
        return (split, split) if self.two_axes() else split


def make_model(args):
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(args.seed)
    cfg = MixtralConfig(vocab_size=args.vocab, hidden_size=args.embd, intermediate_size=2 * args.embd,
                        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=args.block,
                        use_cache=False, experts_implementation=args.experts_implementation,
                        output_router_logits=args.aux_loss > 0, router_aux_loss_coef=args.aux_loss)
    return MixtralForCausalLM(cfg)


def switch_loss_float64(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """transformers' load_balancing_loss_func (Switch Transformer's E * sum_e f_e * P_e over
    every layer's router logits) with its sums in float64 instead of float32: on micro-batches
    float32 sums round otherwise than on the whole batch (1 ulp of the loss), so `graphc check`
    holds 1e-10 only with these (--aux-float64)."""
    counts = probs = 0.0
    rows = 0
    for logits in gate_logits:
        weights = torch.softmax(logits.double(), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        counts = counts + torch.histc(chosen.reshape(-1).to(weights.dtype), bins=num_experts, min=0, max=num_experts)
        probs = probs + weights.sum(dim=0)
        rows += weights.shape[0]
    return torch.sum((counts / rows) * (probs / rows)) * num_experts


def use_float64_aux_loss() -> None:
    """Mixtral's forward calling switch_loss_float64 (this script passes no attention mask).
    Once per process: `graphc check` runs every rank's copy of this script in one process, and
    a global replaced again (by another copy's function) would change what a rank's compiled
    graph read, so that rank alone would compile again."""
    from transformers.models.mixtral import modeling_mixtral
    if modeling_mixtral.load_balancing_loss_func.__name__ != switch_loss_float64.__name__:
        modeling_mixtral.load_balancing_loss_func = switch_loss_float64


class MoEGraph(graphc.Graph):
    def __init__(self, model, opt, layout: Layout, accumulation: int):
        super().__init__()
        self.model = model
        n = model.config.num_hidden_layers
        stage_of = (lambda i: i * layout.pp // n)
        body = self.model.model
        if layout.pp > 1:  # self.model gives graphc's view of each module, with its .config
            body.embed_tokens.config.set_stage(0, layout.placement(0))
            for i in range(n):
                body.layers[i].config.set_stage(stage_of(i), layout.placement(stage_of(i)))
            last = layout.pp - 1
            body.norm.config.set_stage(last, layout.placement(last))
            self.model.lm_head.config.set_stage(last, layout.placement(last))
        elif layout.world > 1:
            self.model.config.set_stage(0, layout.placement(0))
        if layout.ep > 1:
            for i, block in enumerate(model.model.layers):
                graphc.to_global(block.mlp.experts, placement=layout.placement(stage_of(i)),
                                 sbp=layout.experts_sbp())
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(opt)

    def build(self, ids, labels):
        out = self.model(input_ids=ids, labels=labels)
        out.loss.backward()
        return out.loss


def rank_inputs(layout: Layout, rank: int, ids, labels):
    """This rank's rows: ids on the first stage's ranks, labels on the last's."""
    if layout.dp * layout.ep == 1:
        return ids, labels
    k = rank % (layout.dp * layout.ep)
    first, last = layout.placement(0), layout.placement(layout.pp - 1)
    parts = layout.dp * layout.ep
    return (graphc.to_global(ids.chunk(parts)[k], placement=first, sbp=layout.batch_sbp()),
            graphc.to_global(labels.chunk(parts)[k], placement=last, sbp=layout.batch_sbp()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--dp", type=int, default=1, help="data replicas of each expert shard")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks per row")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embd", type=int, default=32)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=64)
    # graphc traces every implementation as one op; batched_mm is the one eager PyTorch runs in
    # float64 on CPU (grouped_mm's kernel refuses it), which `graphc check` compares against
    parser.add_argument("--experts-implementation", default="batched_mm",
                        choices=["batched_mm", "grouped_mm", "eager"])
    # the router's load-balancing loss (transformers' load_balancing_loss_func): exact under
    # accumulation by a routing pre-pass, about one extra forward per step (docs/sbp.md).
    # transformers sums it in float32, so `graphc check` (float64, 1e-10) sees those roundings
    # on split batches, with or without accumulation (measured: 2e-10 at 0.01 on ep2)
    parser.add_argument("--aux-loss", type=float, default=0.0,
                        help="router_aux_loss_coef; > 0 turns output_router_logits on")
    parser.add_argument("--aux-float64", action="store_true",
                        help="the aux loss's sums in float64 (switch_loss_float64), for graphc check at 1e-10")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    layout = Layout(args.pp, args.dp, args.ep)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world != layout.world:
        raise SystemExit(f"--pp {args.pp} --dp {args.dp} --ep {args.ep} needs {layout.world} "
                         f"processes; launch with torchrun --nproc_per_node {layout.world}")
    if args.aux_float64:
        use_float64_aux_loss()
    model = make_model(args)
    graph = MoEGraph(model, torch.optim.SGD(model.parameters(), lr=args.lr), layout, args.accumulation)
    g = torch.Generator().manual_seed(args.seed)  # every rank draws the same batches
    losses = []
    for step in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.block), generator=g)
        labels = torch.roll(ids, -1, dims=1)
        loss = graph(*rank_inputs(layout, rank, ids, labels)).to_local()
        if loss.numel():
            losses.append(loss.item())
            if rank == world - 1:
                print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    return losses


if __name__ == "__main__":
    main()
