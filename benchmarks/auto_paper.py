"""Quality on paper (issue 35): a Llama-3-8B-shaped model on 64 h100 ranks (the simulator's
preset): the layout `graphc.auto.search` picks, beside the best of a wider search and the
layouts torchtitan and Megatron-LM publish for that size, every one compiled for 64 ranks,
simulated and checked by the memory model.

    PYTHONPATH=. python benchmarks/auto_paper.py [--seq 8192] [--batch 64] [--workers 2] [--out plans_paper]

The model is transformers' LlamaForCausalLM with Llama-3-8B's shape (hidden 4096, MLP 14336,
32 layers, 32 heads, 8 KV heads, vocab 128256; 8.0 B parameters) built under
`torch.device("meta")`: nothing of its 32 GB is allocated, graphc traces CPU fakes of the
meta parameters. float32 parameters and AdamW, matmuls under autocast (enable_amp: bf16), as
the published recipes train (bf16 compute, fp32 master weights). Global batch: --batch
sequences of --seq tokens (64 x 8192: torchtitan's llama3_8b.toml, batch 1 a rank on 64 ranks).

1. The search, as `graphc plan --auto --device h100` runs it (budget 60 s, 8 candidates
   compiled, both bounds ending it once a layout fits by the memory model), timed, with this
   process's peak RSS after it.
2. The wider search ("exhaustive" below, what it covers said exactly): the search space is
   enumerate_layouts' 1008 candidates (68 kinds: pipeline x tensor x data degree x schedule;
   within a kind micro-batches x ZeRO x checkpointing). Compiling all 1008 for 64 ranks takes
   ~6 s each here (~1.7 h on 2 cores), so by default it covers
     a. every kind, in the order of its best estimate: its best-estimated setting without
        checkpointing and the same setting with checkpointing, then
     b. every setting of the --leaders kinds (default 3) fastest in (a) that fit.
   A layout and its twin that differs only in checkpointing are scored from one compile
   (their plans differ only in the `checkpointing` field the simulator and the memory model
   read; each worker compiles its first twin too and checks every rank's instructions
   are the same);
   `--full` compiles every candidate instead. The searched layout is compared with the best
   that fits by the memory model among all those compiled (the search's own 8 included).
3. The published layouts, compiled and simulated the same way:
   * torchtitan, torchtitan/models/llama3/train_configs/llama3_8b.toml (a preset for 64
     GPUs): data_parallel_shard_degree -1 (FSDP over all ranks), tp 1, pp 1, batch 1, seq
     8192, selective activation checkpointing -> pp1 tp1 dp64 zero3, checkpointing always
     (graphc has no selective policy: whole layers are recomputed); and its 2-D variant
     tp8 x dp8 (FSDP + TP) -> pp1 tp8 dp8 zero3 ckpt always;
   * Megatron-LM, examples/llama/train_llama3_8b_h100_fp8.sh: TP 1, PP 1, CP 1, micro batch
     1, --use-distributed-optimizer (optimizer states sharded: ZeRO-1), no recomputation ->
     pp1 tp1 dp64 zero1 (it trains fp8; simulated here in bf16).
Writes OUT/auto.md (the search's report, then "Exhaustive" and "Published layouts"
sections) and OUT/layout.json. A benchmark, not a test.
"""
import argparse
import multiprocessing
import os
import resource
import subprocess
import time
from dataclasses import replace
from typing import List, Tuple

import torch

import graphc
from graphc.auto.layout import Layout, batched_inputs, with_layers
from graphc.auto.search import (Candidate, _simulate, enumerate_layouts, estimate, judge, model_facts,
                                search)
from graphc.tools.costs import DEVICES

NPROC, DEVICE = 64, "h100"
PUBLISHED = [
    ("torchtitan llama3_8b.toml (FSDP over 64)", Layout(1, 1, 64, "1f1b", 1, 3, "always")),
    ("torchtitan 2-D (FSDP x TP8)", Layout(1, 8, 8, "1f1b", 1, 3, "always")),
    ("Megatron-LM train_llama3_8b_h100_fp8.sh", Layout(1, 1, 64, "1f1b", 1, 1, "never")),
]


class Llama8B(graphc.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config.enable_amp(True)
        self.add_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))

    def build(self, idx, targets):
        logits = self.model(input_ids=idx).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        return loss


def make_graph(seq: int) -> Llama8B:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=seq, rope_theta=500000.0, use_cache=False)
    with torch.device("meta"):
        return Llama8B(LlamaForCausalLM(config))


# the wider search's workers: spawned (a fork after torch's thread pools ran hangs), each
# building the model and inputs once from `_setup`'s arguments; only numbers come back
_JOB = {}


def _setup(seq: int, batch: int, capacity: int) -> None:
    torch.set_num_threads(1)
    graph = make_graph(seq)
    spec = graph._compile_spec()
    inputs = make_inputs(seq, batch)
    _JOB.update(spec=spec, inputs=inputs, batched=batched_inputs(inputs, ["idx", "targets"], spec.whole_inputs),
                optimizer=graph._optimizer, capacity=capacity, read_at={})


def _score(group: Tuple[Layout, ...]):
    """Each layout of `group` (settings that differ only in checkpointing) from one compile of
    the first: checkpointing changes only the plans' `checkpointing` field, which the simulator
    (NOTE: Recompute cost) and the memory model read; each worker checks that on the first
    group it scores by compiling the twins too and comparing every rank's instructions."""
    j = _JOB
    first = Candidate(group[0], 0.0, 0)
    compiled = _simulate(first, j["spec"], j["inputs"], NPROC, j["batched"], j["optimizer"], DEVICE,
                         j["capacity"], j["read_at"])
    out = [first]
    for lay in group[1:]:
        c = Candidate(lay, 0.0, 0)
        if compiled is None or not j.setdefault("checked", False):
            own = _simulate(c, j["spec"], j["inputs"], NPROC, j["batched"], j["optimizer"], DEVICE,
                            j["capacity"], j["read_at"])
            if compiled is not None and own is not None:
                _same_instructions(compiled, own, lay)
                j["checked"] = True
        else:
            plans = [replace(p, checkpointing=lay.checkpointing) for p in compiled.plans]
            judge(c, compiled, plans, j["optimizer"], DEVICE, j["capacity"])
        out.append(c)
    return [(c.step, c.peak, c.peak_rank, c.note) for c in out]


def _same_instructions(compiled, twin, lay: Layout) -> None:
    for a, b in zip(compiled.plans, twin.plans):
        if [str(i) for i in a.instructions] != [str(i) for i in b.instructions]:
            raise SystemExit(f"{lay.describe()}: rank {a.rank}'s plan differs from its twin's beyond "
                             "checkpointing; score every layout by its own compile")


def make_inputs(seq: int, batch: int) -> list:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128256, (batch, seq), generator=g), torch.randint(0, 128256, (batch, seq), generator=g)]


def score_all(layouts: List[Layout], workers: int, setup: tuple, facts) -> List[Candidate]:
    """Every layout compiled for 64 ranks (twins differing only in checkpointing from one
    compile: _score), simulated and memory-checked, in `workers` processes."""
    t0 = time.perf_counter()
    groups: dict = {}
    for lay in layouts:
        groups.setdefault(replace(lay, checkpointing="never"), []).append(lay)
    groups = [tuple(sorted(set(g), key=lambda l: l.checkpointing != "never")) for g in groups.values()]
    out = []
    with multiprocessing.get_context("spawn").Pool(workers, _setup, setup) as pool:
        for group, results in zip(groups, pool.imap(_score, groups)):
            for lay, got in zip(group, results):
                c = Candidate(lay, *estimate(lay, facts))
                c.step, c.peak, c.peak_rank, c.note = got
                out.append(c)
                print(f"  [{len(out)}/{len(layouts)} {time.perf_counter() - t0:5.0f} s] {lay.describe():<40} "
                      f"{(c.step or float('nan')) * 1e3:9.1f} ms  {(c.peak or 0) / 2**30:6.1f} GiB  {c.note[:50]}",
                      flush=True)
    return out


def wide_layouts(every: List[Layout], facts, leaders: int, full: bool, workers: int, setup: tuple):
    """The wider search (module docstring, 2): returns every candidate it compiled."""
    if full:
        return score_all(every, workers, setup, facts)
    kinds = {}
    for lay in every:
        kinds.setdefault((lay.pp, lay.tp, lay.dp, lay.schedule), []).append(lay)
    first = []      # the kinds in the order of their best estimates: the likeliest best first
    for lays in sorted(kinds.values(), key=lambda lays: min(estimate(l, facts)[0] for l in lays)):
        plain = min((l for l in lays if l.checkpointing == "never"), key=lambda l: estimate(l, facts)[0])
        first += [plain] + [l for l in lays if l == replace(plain, checkpointing="always")]
    print(f"wider search (a): {len(first)} layouts, the best estimate of each kind without checkpointing "
          "and the same with it", flush=True)
    done = score_all(first, workers, setup, facts)
    fit = sorted((c for c in done if c.fits and c.step is not None), key=lambda c: c.step)
    lead = []
    for c in fit:
        kind = (c.layout.pp, c.layout.tp, c.layout.dp, c.layout.schedule)
        if kind not in lead:
            lead.append(kind)
    lead = lead[:leaders]
    seen = {c.layout for c in done}
    second = [l for k in lead for l in kinds[k] if l not in seen]
    print(f"wider search (b): {len(second)} more layouts, every setting of the kinds {lead}", flush=True)
    return done + score_all(second, workers, setup, facts)


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip().split("load average:")[-1].strip()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--leaders", type=int, default=3)
    p.add_argument("--full", action="store_true", help="compile every candidate (hours here)")
    p.add_argument("--out", default="plans_paper")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    graph = make_graph(args.seq)
    spec = graph._compile_spec()
    inputs = make_inputs(args.seq, args.batch)
    batched = batched_inputs(inputs, ["idx", "targets"], spec.whole_inputs)
    capacity = int(DEVICES[DEVICE].memory_gib * 2 ** 30)
    load_before = load()

    # 1. the search, as graphc plan --auto runs it
    t0 = time.perf_counter()
    result = search(spec, inputs, NPROC, batched, graph._optimizer, DEVICE)
    search_s = time.perf_counter() - t0
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    load_search = load()
    picked = result.best
    print(f"search: {picked.layout.describe()} simulated {picked.step * 1e3:.1f} ms in {search_s:.1f} s, "
          f"peak RSS {rss_gib:.2f} GiB (load {load_before} -> {load_search})", flush=True)

    # 2. the wider search and 3. the published layouts, each compiled for 64 ranks
    facts = model_facts(spec, inputs, graph._optimizer, DEVICE)
    setup = (args.seq, args.batch, capacity)
    every = enumerate_layouts(facts, NPROC, spec.root)
    t1 = time.perf_counter()
    wide = wide_layouts(every, facts, args.leaders, args.full, args.workers, setup)
    wide_s = time.perf_counter() - t1
    published = score_all([with_layers(l, spec.root) for _, l in PUBLISHED], args.workers, setup, facts)
    load_after = load()

    # the best of all compiled: the wider search's and the search's own round 2
    seen = {c.layout for c in wide}
    fit = sorted((c for c in wide + [c for c in result.tried if c.layout not in seen]
                  if c.fits and c.step is not None), key=lambda c: c.step)
    best = fit[0]
    ratio = picked.step / best.step
    # the same comparison among the layouts without checkpointing (the simulator charges a
    # checkpointed micro-batch's recomputed forward: NOTE: Recompute cost)
    plain = [c for c in fit if c.layout.checkpointing == "never"]
    ratio_plain = picked.step / plain[0].step if plain else float("nan")
    print(f"wider search: {len(wide)} compiled in {wide_s:.0f} s, best {best.layout.describe()} "
          f"{best.step * 1e3:.1f} ms; searched / best = {ratio:.3f}", flush=True)

    gib = 2 ** 30
    lines = ["", "## Exhaustive", "",
             f"Llama-3-8B shape (LlamaForCausalLM on the meta device, 8.0 B parameters, AdamW, bf16 autocast), "
             f"batch {args.batch} x {args.seq} tokens, {NPROC} ranks of {DEVICE}, {capacity / gib:.0f} GiB a rank. "
             f"`PYTHONPATH=. python benchmarks/auto_paper.py` (load average before {load_before}, after the "
             f"search {load_search}, at the end {load_after}; 2 cores).", "",
             f"- search: {search_s:.1f} s, peak RSS {rss_gib:.2f} GiB; picked {picked.layout.describe()}, "
             f"simulated step {picked.step * 1e3:.1f} ms",
             f"- wider search: {len(wide)} of the {len(every)} candidates compiled for {NPROC} ranks and simulated "
             + ("(all of them)" if args.full else
                f"(every kind's best estimate without checkpointing and the same with it, then every setting "
                f"of the {args.leaders} fastest kinds; twins differing only in checkpointing from one compile)") + f" in {wide_s:.0f} s with {args.workers} workers; "
             f"{len(fit)} fit by the memory model; best {best.layout.describe()}, {best.step * 1e3:.1f} ms",
             f"- **searched / best = {ratio:.3f}** (target <= 1.05)",
             f"- searched / best without checkpointing = {ratio_plain:.3f}"
             + (f" (best {plain[0].layout.describe()}, {plain[0].step * 1e3:.1f} ms)" if plain else ""),
             f"- the search compiled {len(result.tried)}, skipped {len(result.skipped)} predicted not to fit "
             f"(NOTE: Memory check of the search); {sum(not c.fits for c in result.tried)} of those compiled "
             "did not fit by the memory model", "",
             "| rank | layout | simulated step ms | peak GiB (rank) |", "|---|---|---|---|"]
    for i, c in enumerate(fit[:10]):
        mark = " (searched)" if c.layout == picked.layout else ""
        lines.append(f"| {i + 1} | {c.layout.describe()}{mark} | {c.step * 1e3:.1f} | {c.peak / gib:.1f} ({c.peak_rank}) |")
    lines += ["", "## Published layouts", "",
              "Compiled for the same model, batch and ranks, simulated and memory-checked the same way.", "",
              "| source | layout | simulated step ms | x searched | peak GiB (rank) | fits |",
              "|---|---|---|---|---|---|"]
    for (source, _), c in zip(PUBLISHED, published):
        step = f"{c.step * 1e3:.1f}" if c.step is not None else "-"
        times = f"{c.step / picked.step:.2f}" if c.step is not None else "-"
        peak = f"{c.peak / gib:.1f} ({c.peak_rank})" if c.peak is not None else "-"
        lines.append(f"| {source} | {c.layout.describe()} | {step} | {times} | {peak} | "
                     f"{'yes' if c.fits else c.note} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "auto.md"), "w") as f:
        f.write(result.report() + "\n".join(lines) + "\n")
    with open(os.path.join(args.out, "layout.json"), "w") as f:
        f.write(picked.layout.to_json())
    print("\n".join(lines))
    print(f"wrote {args.out}/auto.md and layout.json")


if __name__ == "__main__":
    main()
