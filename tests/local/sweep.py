"""The equivalence sweep's configurations: layouts x schedules x accumulation x models, each
run in a local world (every rank a thread, NOTE: Local world) and checked against eager on
the whole batch at every step (float64, 1e-10; NOTE: Checked steps).

Models: SkipNet (an MLP whose first block skips to the head), the GPT example (tied
embedding, vocabulary-parallel head, Megatron tensor parallel), a conv net with BatchNorm
(deferred statistics under accumulation, synced over data parallel), and Hugging Face
Llama with a padded attention mask and ignore_index labels.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass
from typing import List, Tuple

import torch
import torch.nn as nn

import graphc
import graphc.testing
from graphc.plan.schedules import SCHEDULES, accepts, stage_count
from graphc.plan.schedules import layout as schedule_layout
from conv_models import ConvNet
from models import SkipNet, make_batches

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
STEPS = 2


def schedules() -> List[str]:
    """Every registered schedule, read when the sweep is built (See NOTE: Schedule registry)."""
    return sorted(SCHEDULES)


def chunks(schedule: str) -> int:
    """Stages per pipeline rank the sweep gives `schedule`: two where its layout takes several."""
    return stage_count(schedule, 1)


@dataclass(frozen=True)
class Config:
    model: str
    pp: int = 1
    dp: int = 1
    tp: int = 1
    schedule: str = "1f1b"
    acc: int = 1
    checkpointing: str = "never"
    zero: int = 0                     # config.enable_zero stage (0: off)
    amp: bool = False                 # config.enable_amp(True, torch.bfloat16) (float32 runs)
    sp: bool = False                  # config.enable_sequence_parallel(True) (NOTE: Sequence parallel)

    @property
    def nproc(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def id(self) -> str:
        sched = f"-{self.schedule}" if self.pp > 1 else ""
        ckpt = f"-ckpt_{self.checkpointing}" if self.checkpointing != "never" else ""
        zero = f"-zero{self.zero}" if self.zero else ""
        amp = "-amp" if self.amp else ""
        sp = "-sp" if self.sp else ""
        return f"{self.model}-pp{self.pp}-dp{self.dp}-tp{self.tp}{sched}-acc{self.acc}{ckpt}{zero}{amp}{sp}"


def _valid(c: Config) -> bool:
    if c.pp == 1:
        return c.schedule == "1f1b"
    return accepts(c.schedule, c.pp, c.pp * chunks(c.schedule), c.acc)


def configurations() -> List[Config]:
    """Every configuration of the sweep, smallest worlds first."""
    out = []
    for pp in (1, 2, 4, 8):                                   # SkipNet: every schedule, data parallel
        for dp in (1, 2, 4):
            if pp * dp == 1 or pp * dp > 16:
                continue
            for schedule in schedules():
                for acc in (1, 2, 4) if pp < 8 else (8, 16):
                    c = Config("skip", pp, dp, 1, schedule, acc)
                    if _valid(c):
                        out.append(c)
    for pp in (2, 4):                                          # SkipNet with activation checkpointing
        for schedule in schedules():
            for acc in (2, 4, 8):
                for ckpt in (("always", "except_last") if pp == 2 else ("always",)):
                    c = Config("skip", pp, 1, 1, schedule, acc, ckpt)
                    if _valid(c):
                        out.append(c)
    for pp, dp in ((1, 2), (1, 4), (2, 2)):                   # SkipNet with ZeRO stages 1, 2 and 3
        for zero in (1, 2, 3):
            for acc in (1, 2, 4):
                out.append(Config("skip", pp, dp, 1, "1f1b", acc, zero=zero))
    for schedule in ("zbv", "interleaved_1f1b"):              # two chunks a rank: gathered per compute
        for zero in (2, 3):
            out.append(Config("skip", 2, 2, 1, schedule, 4, zero=zero))
    for pp, tp, dp in ((1, 2, 1), (1, 4, 1), (1, 1, 2), (1, 1, 4), (2, 1, 1), (2, 2, 1), (2, 1, 2),
                       (1, 2, 2), (2, 2, 2), (4, 1, 1), (4, 2, 1), (4, 1, 2), (1, 4, 2), (1, 2, 4),
                       (8, 1, 1), (2, 4, 2), (4, 2, 2), (2, 2, 4), (4, 4, 4)):   # the GPT: ties, 2-D meshes
        for schedule in (("1f1b", "gpipe") if pp > 1 else ("1f1b",)):
            for acc in (1, 2, 4):
                if pp > 1 and acc < 2 and schedule == "gpipe":
                    continue
                out.append(Config("gpt", pp, dp, tp, schedule, acc))
    for pp, tp, dp in ((1, 2, 1), (1, 4, 1), (1, 2, 2), (2, 2, 1), (2, 2, 2)):   # the GPT, sequence parallel
        for acc in ((2, 4) if pp * tp * dp == 2 else (4,)):
            out.append(Config("gpt", pp, dp, tp, "1f1b", acc, sp=True))
    # BatchNorm conv net. Training BatchNorm under accumulation normalises each micro-batch
    # by its own statistics, as eager accumulation does (README: BatchNorm; graphc warns), so
    # the whole-batch oracle holds at accumulation 1; with BatchNorm in eval mode (frozen
    # statistics, a fine-tuning habit) at every accumulation.
    for pp in (1, 2):
        for dp in (1, 2, 4):
            if pp * dp > 1:
                out.append(Config("convbn", pp, dp, 1, "1f1b", 1))
                out += [Config("convbn-frozen", pp, dp, 1, "1f1b", acc) for acc in (1, 2, 4)]
    for pp, dp in ((1, 2), (2, 1), (2, 2)):                     # Llama, attention mask
        for acc in (1, 2):
            out.append(Config("llama", pp, dp, 1, "1f1b", acc))
    return sorted(out, key=lambda c: (c.nproc, c.model, c.id))


# -- models ------------------------------------------------------------------------------
def _ranks(stage_rank: int, dp: int) -> List[int]:
    return list(range(stage_rank * dp, (stage_rank + 1) * dp))


class SkipGraph(graphc.Graph):
    def __init__(self, model, opt, c: Config):
        super().__init__()
        self.model = model
        n = len(model.blocks)
        if c.pp == 1:
            self.model.config.set_stage(0, graphc.placement("cpu", _ranks(0, c.dp)))
        else:
            rank_of = {s: r for r, stages in enumerate(schedule_layout(c.schedule, c.pp, n)) for s in stages}
            for s in range(n):
                self.model.blocks[s].config.set_stage(s, graphc.placement("cpu", _ranks(rank_of[s], c.dp)))
            self.model.head.config.set_stage(n - 1, graphc.placement("cpu", _ranks(rank_of[n - 1], c.dp)))
        self.loss_fn = nn.CrossEntropyLoss()
        self.config.set_gradient_accumulation_steps(c.acc)
        self.config.set_pipeline_schedule(c.schedule)
        self.config.set_activation_checkpointing(c.checkpointing)
        if c.zero:
            self.config.enable_zero(True, stage=c.zero, shard_min_size=1)
        if c.amp:
            self.config.enable_amp(True, torch.bfloat16)
        self.add_optimizer(opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def _split_over_data(c: Config, batches: list, readers: List[int]):
    """The batches as each rank passes them under data parallelism: every input split(0) over
    the data-parallel ranks of the stage that reads it (`readers`: that stage's pipeline rank
    per input), rank k of them holding the k-th chunk of rows; a rank outside passes rows that
    are not read. With one data-parallel rank, the plain batches (whole on every rank)."""
    if c.dp == 1:
        return batches

    def inputs(rank, step):
        out = []
        for t, reader in zip(batches[step], readers):
            ranks = _ranks(reader, c.dp)
            k = ranks.index(rank) if rank in ranks else 0
            out.append(graphc.to_global(t.chunk(c.dp)[k], placement=graphc.placement("cpu", ranks),
                                        sbp=graphc.sbp.split(0)))
        return tuple(out)
    return inputs


def _skip(c: Config):
    stages = c.pp * chunks(c.schedule) if c.pp > 1 else 2

    def make():
        torch.manual_seed(0)
        model = SkipNet(stages, d=8)
        return SkipGraph(model, torch.optim.Adam(model.parameters(), lr=0.01), c)
    batch = max(8, 2 * c.acc * c.dp)
    last = 0
    if c.pp > 1:   # the pipeline rank of the last stage (the loss reads the labels there)
        last = next(r for r, held in enumerate(schedule_layout(c.schedule, c.pp, stages)) if stages - 1 in held)
    return make, _split_over_data(c, make_batches(n=STEPS, batch=batch, d=8), [0, last])


class ConvGraph(graphc.Graph):
    def __init__(self, model, opt, c: Config):
        super().__init__()
        self.model = model
        if c.model == "convbn-frozen":  # fine-tuning with BatchNorm's statistics frozen
            model.eval()
        if c.pp == 1:
            self.model.config.set_stage(0, graphc.placement("cpu", _ranks(0, c.dp)))
        else:
            for name in ("stem", "layer1"):
                getattr(self.model, name).config.set_stage(0, graphc.placement("cpu", _ranks(0, c.dp)))
            for name in ("layer2", "pool", "seq", "gap", "flatten", "fc"):
                getattr(self.model, name).config.set_stage(1, graphc.placement("cpu", _ranks(1, c.dp)))
        self.config.set_gradient_accumulation_steps(c.acc)
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _convbn(c: Config):
    def make():
        torch.manual_seed(0)
        model = ConvNet()
        return ConvGraph(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), c)
    g = torch.Generator().manual_seed(1)
    batch = 4 * c.acc * c.dp
    return make, _split_over_data(c, [(torch.randn(batch, 3, 8, 8, generator=g) + 3.0,
                                       torch.randint(0, 5, (batch,), generator=g)) for _ in range(STEPS)],
                                  [0, c.pp - 1])


def _gpt_module():
    """examples/gpt.py, loaded by its path (benchmarks/gpt.py is another `gpt` on sys.path)."""
    name = "graphc_examples_gpt"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, "gpt.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _gpt(c: Config):
    gpt = _gpt_module()
    lay = gpt.Layout(c.pp, c.tp, c.dp)
    ids, vocab = gpt.load_corpus()
    args = type("Args", (), dict(seed=0, block=8, layers=max(2, c.pp), heads=4, embd=16))
    batches = list(gpt.batches(ids, 2 * c.acc * c.dp, 8, STEPS, 0))

    def make():
        model = gpt.make_model(vocab, args)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        graph = gpt.GPTGraph(model, opt, lay, c.acc, c.schedule)
        graph.config.enable_sequence_parallel(c.sp)
        return graph

    def inputs(rank, step):
        return gpt.global_inputs(lay, rank, *batches[step])
    return make, inputs


class LlamaGraph(graphc.Graph):
    def __init__(self, model, opt, c: Config):
        super().__init__()
        self.model = model
        if c.pp > 1:
            for path, sid in (("model.embed_tokens", 0), ("model.layers.0", 0), ("model.layers.1", 1),
                              ("model.norm", 1), ("lm_head", 1)):
                block = self.model
                for part in path.split("."):
                    block = block[int(part)] if part.isdigit() else getattr(block, part)
                block.config.set_stage(sid, graphc.placement("cpu", _ranks(sid, c.dp)))
        elif c.dp > 1:
            self.model.config.set_stage(0, graphc.placement("cpu", _ranks(0, c.dp)))
        self.config.set_gradient_accumulation_steps(c.acc)
        self.add_optimizer(opt)

    def build(self, ids, mask, labels):
        out = self.model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        return out.loss


def _llama(c: Config):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)

    def make():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        return LlamaGraph(model, torch.optim.AdamW(model.parameters(), lr=1e-3), c)
    g = torch.Generator().manual_seed(0)
    B, T = 8, 12
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (B, T), generator=g)
        lengths = torch.randint(2, T + 1, (B,), generator=g)
        mask = (torch.arange(T)[None] < lengths[:, None]).long()
        batches.append((ids, mask, ids.masked_fill(mask == 0, -100)))
    return make, _split_over_data(c, batches, [0, 0, c.pp - 1])


BUILD: dict = {"skip": _skip, "gpt": _gpt, "convbn": _convbn, "convbn-frozen": _convbn, "llama": _llama}


def run(c: Config) -> graphc.testing.LocalRun:
    """The configuration in a local world, every step checked against eager."""
    make, inputs = BUILD[c.model](c)
    return graphc.testing.local_world(make, inputs, c.nproc, steps=STEPS, check=True)


def check(c: Config) -> Tuple[bool, str]:
    """Whether the configuration's every step agrees with eager, and the report. A stage whose
    ranks all compute the same thing (warn_replicated_stages) fails it: the configuration
    would not be the data parallelism it names."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run(c)
    replicated = [str(w.message) for w in caught if "computes the same thing" in str(w.message)]
    if replicated:
        return False, f"{c.id}: {replicated[0]}"
    return result.ok, result.text()


def time_all(configs: List[Config], out=sys.stdout) -> None:
    """Times every configuration (python tests/local/sweep.py): the CI split reads these."""
    import time
    for c in configs:
        t = time.perf_counter()
        ok, text = check(c)
        print(f"{c.id} {c.nproc} {time.perf_counter() - t:.2f} {'ok' if ok else 'DIFFERS'}", file=out, flush=True)
        if not ok:
            print(text, file=out, flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    torch.set_default_dtype(torch.float64)
    cs = configurations()
    print(len(cs), "configurations", flush=True)
    time_all(cs)
