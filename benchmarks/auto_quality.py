"""How good is the automatic layout? The GPT example (or HF Llama) on N ranks of the local world:
the layout `graphc.auto.search` picks, measured beside a grid of hand layouts (issue 35's check).

    python benchmarks/auto_quality.py                 # short: one layout per (pp, tp, dp)
    python benchmarks/auto_quality.py --model llama   # transformers' LlamaForCausalLM, tiny
    python benchmarks/auto_quality.py --full          # every layout the search enumerates
    python benchmarks/auto_quality.py --device h100   # the pick for another device preset
                                                      # (default cpu: one CPU core per rank)

Each layout trains the same float64 model (config.load_layout on a Graph that declares
nothing) in a local world of --nproc ranks: every rank a thread running the plan torchrun
would run, collectives in memory (NOTE: Local world). After --warmup steps (the compile
included), --steps steps are timed between barriers; a layout's step is the slowest rank's
median; the pick and the best three are measured once more, in reverse order, and keep
their faster step. Losses and parameters are compared with eager PyTorch on the whole batch
(1e-10). The grid is the search's own candidate set (graphc.auto.search.enumerate_layouts:
pipeline x tensor x data degrees, schedule, micro-batches, ZeRO, checkpointing); --full
measures all of it, the short mode the first of each (pp, tp, dp) with 1F1B, the fewest
micro-batches, no ZeRO and no checkpointing. The target (issue 35): the pick's measured step
at most 1.10x the grid's best. On a machine shared by other work the ranks' threads share
its cores, so run it quiet and read the load it prints; beside the median step it prints
the fastest step and the process's CPU time a step (the ranks are its threads, one running
at a time, so that is their work and hand-offs, and other processes' load does not add to it).
"""
import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import graphc  # noqa: E402
from graphc.auto.layout import Layout, batched_inputs, with_layers  # noqa: E402
from graphc.auto.search import enumerate_layouts, model_facts, search  # noqa: E402
from graphc.runtime.local_world import LocalWorld  # noqa: E402
from graphc import world  # noqa: E402
from auto_layout import AutoGPT  # noqa: E402
from gpt import GPT, GPTConfig, lm_loss  # noqa: E402

TOLERANCE = 1e-10


@dataclass
class Measured:
    layout: Layout
    step_s: Optional[float] = None       # the slowest rank's median step
    fastest_s: Optional[float] = None    # the fastest step (each step: its slowest rank)
    cpu_s: Optional[float] = None        # the process's median CPU seconds a step (every rank)
    max_diff: Optional[float] = None     # largest loss or parameter difference from eager
    error: str = ""


def make_model(args):
    """The GPT example, or Hugging Face's LlamaForCausalLM as it comes (a tiny config)."""
    torch.manual_seed(0)
    if args.model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=65, hidden_size=args.embd, intermediate_size=2 * args.embd,
            num_hidden_layers=args.layers, num_attention_heads=args.heads,
            num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.block,
            use_cache=False))
    return GPT(GPTConfig(vocab_size=65, block_size=args.block, n_layer=args.layers,
                         n_head=args.heads, n_embd=args.embd))


class AutoLlama(AutoGPT):
    """The Llama's logits under the GPT's float64 loss: its own loss upcasts the logits to
    float32, which no 1e-10 comparison survives."""

    def build(self, idx, targets):
        loss = lm_loss(self.model(input_ids=idx).logits, targets)
        loss.backward()
        return loss


def logits_of(model, idx):
    out = model(idx) if isinstance(model, GPT) else model(input_ids=idx)
    return out if isinstance(out, torch.Tensor) else out.logits


def make_graph(args, layout: Optional[Layout]) -> AutoGPT:
    model = make_model(args)
    kind = AutoLlama if args.model == "llama" else AutoGPT
    return kind(model, torch.optim.SGD(model.parameters(), lr=0.1), layout)


def make_batches(args) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 65, (args.batch, args.block), generator=g),
             torch.randint(0, 65, (args.batch, args.block), generator=g))
            for _ in range(args.warmup + args.steps)]


def eager_run(args, batches):
    """Losses and final parameters of eager PyTorch on the whole batch."""
    model = make_model(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        loss = lm_loss(logits_of(model, x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def measure(args, layout: Layout, batches, eager) -> Measured:
    """Trains `layout` in a local world: timed steps and the largest difference from eager."""
    def rank_main(rank):
        graph = make_graph(args, layout)
        losses, times, cpu = [], [], []
        for i, (x, y) in enumerate(batches):
            world.current().barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            out = graph(x, y).to_local()
            world.current().barrier()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            losses.append(float(out) if out.numel() else None)
        return losses, (times, cpu), graph.full_state_dict(rank0_only=True)

    result = Measured(layout)
    try:
        runs = LocalWorld(layout.world).run(rank_main)
    except graphc.GraphcError as exc:
        result.error = str(exc).splitlines()[0][:160]
        return result
    steps = [max(step) for step in zip(*(times for _, (times, _), _ in runs))]   # between barriers
    result.step_s = max(statistics.median(times) for _, (times, _), _ in runs)
    result.fastest_s = min(steps)
    # the ranks are threads of this process, one running at a time: its CPU time between the
    # barriers is their work and hand-offs, which other processes' load does not add to
    result.cpu_s = max(statistics.median(cpu) for _, (_, cpu), _ in runs)
    want_losses, want_state = eager
    got_losses = next(losses for losses, _, _ in runs if losses[0] is not None)
    diffs = [abs(a - b) for a, b in zip(got_losses, want_losses)]
    diffs += [(runs[0][2][k] - v).abs().max().item() for k, v in want_state.items()]
    result.max_diff = max(diffs)
    return result


def remeasure_finalists(args, measured: List[Measured], pick: Layout, root, batches, eager) -> None:
    """The pick and the best three measured again, in reverse order of the first pass, each
    keeping its faster step: a shared machine's load then weighs on them alike."""
    done = sorted((m for m in measured if m.step_s is not None), key=lambda m: m.step_s)
    finalists = [m for m in measured if m in done[:3] or m.layout == pick][::-1]
    for m in finalists:
        again = measure(args, with_layers(m.layout, root), batches, eager)
        if again.step_s is not None:
            print(f"again: {m.layout.describe():<32} {again.step_s * 1e3:8.1f} ms "
                  f"(fastest {again.fastest_s * 1e3:.1f}, CPU {again.cpu_s * 1e3:.1f})", flush=True)
            m.step_s = min(m.step_s, again.step_s)
            m.fastest_s = min(m.fastest_s, again.fastest_s)
            m.cpu_s = min(m.cpu_s, again.cpu_s)
            m.max_diff = max(m.max_diff, again.max_diff)


def grid(args, root, facts) -> List[Layout]:
    """The hand layouts: the search's whole candidate set (--full), or the first of each
    (pp, tp, dp) with 1F1B, the fewest micro-batches, no ZeRO and no checkpointing."""
    every = enumerate_layouts(facts, args.nproc, root)
    if args.full:
        return every
    firsts = {}
    for lay in every:
        key = (lay.pp, lay.tp, lay.dp)
        plain = lay.schedule == "1f1b" and lay.zero == 0 and lay.checkpointing == "never"
        if plain and (key not in firsts or lay.microbatches < firsts[key].microbatches):
            firsts[key] = lay
    return list(firsts.values())


def auto_pick(args, graph, batches) -> Layout:
    """What graphc plan --auto (and enable_auto_parallel) choose for this model and world."""
    spec = graph._compile_spec()
    x, y = batches[0]
    batched = batched_inputs([x, y], ["idx", "targets"], spec.whole_inputs)
    result = search(spec, [x, y], args.nproc, batched, graph._optimizer, args.device,
                    budget_s=args.budget_s, progress=False)
    return result.best.layout


def report(args, measured: List[Measured], pick: Layout, load: str) -> str:
    done = sorted((m for m in measured if m.step_s is not None), key=lambda m: m.step_s)
    best = done[0]
    quickest = min(done, key=lambda m: m.fastest_s)
    least = min(done, key=lambda m: m.cpu_s)
    mine = next(m for m in measured if m.layout == pick)
    lines = [f"# Auto layout quality: {args.model} {args.layers} layers, width {args.embd}, batch {args.batch} x "
             f"{args.block}, float64, {args.nproc} ranks (local world)", "",
             f"load before: {load}; {len(measured)} layouts, {args.steps} timed steps each after "
             f"{args.warmup} warm-up; auto pick for device preset '{args.device}'.", "",
             "| layout | median step ms | x best | fastest step ms | x best | CPU ms a step | x best "
             "| max diff from eager |", "|---|---|---|---|---|---|---|---|"]
    for m in done:
        mark = " **auto**" if m is mine else ""
        lines.append(f"| {m.layout.describe()}{mark} | {m.step_s * 1e3:.1f} | {m.step_s / best.step_s:.2f} "
                     f"| {m.fastest_s * 1e3:.1f} | {m.fastest_s / quickest.fastest_s:.2f} "
                     f"| {m.cpu_s * 1e3:.1f} | {m.cpu_s / least.cpu_s:.2f} | {m.max_diff:.1e} |")
    for m in measured:
        if m.step_s is None:
            lines.append(f"| {m.layout.describe()} | refused: {m.error} | | | | | | |")
    if mine.step_s is not None:
        ratio = mine.step_s / best.step_s
        lines += ["", f"auto pick {pick.describe()}: {mine.step_s * 1e3:.1f} ms, {ratio:.2f}x the best "
                  f"({best.layout.describe()}, {best.step_s * 1e3:.1f} ms); target <= 1.10x: "
                  + ("met" if ratio <= 1.10 else "MISSED"),
                  f"fastest steps: the pick {mine.fastest_s * 1e3:.1f} ms, {mine.fastest_s / quickest.fastest_s:.2f}x "
                  f"the quickest ({quickest.layout.describe()}, {quickest.fastest_s * 1e3:.1f} ms); CPU a step: "
                  f"the pick {mine.cpu_s * 1e3:.1f} ms, {mine.cpu_s / least.cpu_s:.2f}x the least "
                  f"({least.layout.describe()}, {least.cpu_s * 1e3:.1f} ms)"]
    worst = max(m.max_diff for m in done)
    lines.append(f"numbers: largest difference from eager {worst:.1e} "
                 + ("(<= 1e-10 everywhere)" if worst <= TOLERANCE else "(ABOVE 1e-10)"))
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="measure every layout the search enumerates")
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--model", choices=("gpt", "llama"), default="gpt",
                   help="the GPT example, or Hugging Face's LlamaForCausalLM (tiny, as it comes)")
    p.add_argument("--device", default="cpu", help="the device preset the search models")
    p.add_argument("--budget-s", type=float, default=None,
                   help="bound the search in seconds (default: none, top 8 candidates as at run "
                        "time; a bound in seconds makes the pick depend on the machine's load)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the report to this file")
    args = p.parse_args(argv)
    torch.set_default_dtype(torch.float64)
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else ["?"]
    batches = make_batches(args)
    graph = make_graph(args, None)
    t0 = time.perf_counter()
    pick = auto_pick(args, graph, batches)
    print(f"auto pick: {pick.describe()} (search {time.perf_counter() - t0:.1f} s)", flush=True)
    spec = graph._compile_spec()
    facts = model_facts(spec, list(batches[0]), graph._optimizer, args.device)
    layouts = grid(args, spec.root, facts)
    if pick not in layouts:
        layouts.append(pick)
    eager = eager_run(args, batches)
    measured = []
    for i, lay in enumerate(layouts):
        m = measure(args, with_layers(lay, spec.root), batches, eager)
        measured.append(m)
        print(f"[{i + 1}/{len(layouts)}] {lay.describe():<32} "
              + (f"{m.step_s * 1e3:8.1f} ms (fastest {m.fastest_s * 1e3:6.1f}, CPU {m.cpu_s * 1e3:6.1f})  "
                 f"diff {m.max_diff:.1e}"
                 if m.step_s is not None else m.error),
              flush=True)
    remeasure_finalists(args, measured, pick, spec.root, batches, eager)
    text = report(args, measured, pick, "load average " + " ".join(load))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return measured, pick


if __name__ == "__main__":
    main()
