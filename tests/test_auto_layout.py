"""Automatic layouts (NOTE: Auto layouts in graphc/auto/layout.py, NOTE: Layout search in
graphc/auto/search.py): a layout applied to the GPT example's spec places what a user would
write by hand; the search returns a layout that fits, the same every time; a model that fits
nothing is refused with the memory that would do; and a Graph that declares nothing, trained
on a loaded layout in the local world (every rank passing the whole batch), equals eager
PyTorch on the whole batch in float64 at 1e-10."""
import os
import sys
from dataclasses import replace

import pytest
import torch

import graphc
from graphc.auto import Layout, apply_layout
from graphc.auto.layout import batch_layouts, input_stages, layer_list, megatron_pairs, with_layers
from graphc.auto.search import search
from graphc.errors import GraphcError
from graphc.runtime.local_world import LocalWorld
from helpers import assert_close

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from auto_layout import AutoGPT  # noqa: E402
from gpt import GPT, GPTConfig, lm_loss  # noqa: E402

BATCH, BLOCK = 8, 8


def _gpt(layers=4):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=17, block_size=BLOCK, n_layer=layers, n_head=2, n_embd=16))


def _batches(n=2):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 17, (BATCH, BLOCK), generator=g), torch.randint(0, 17, (BATCH, BLOCK), generator=g))
            for _ in range(n)]


def _graph(layout=None):
    model = _gpt()
    return AutoGPT(model, torch.optim.AdamW(model.parameters(), lr=1e-2), layout)


def test_a_layout_places_layers_ends_and_megatron_pairs():
    graph = _graph()
    spec = graph._compile_spec()
    name, layers = layer_list(spec.root)
    assert name == "model.transformer.h" and len(layers) == 4
    assert megatron_pairs(layers[0], 2) == (["attn.q", "attn.k", "attn.v", "mlp.fc"], ["attn.proj", "mlp.proj"])
    lay = with_layers(Layout(pp=2, tp=2, dp=2, microbatches=2, zero=1), spec.root)
    assert lay.boundaries == (2,) and lay.ranks(1) == [[4, 5], [6, 7]]
    laid = apply_layout(spec, lay)
    stage = {k: m.stage_id for k, m in laid.modules.items()}
    assert stage == {"model.transformer.wte": 0, "model.transformer.wpe": 0, "model.transformer.h.0": 0,
                     "model.transformer.h.1": 0, "model.transformer.h.2": 1, "model.transformer.h.3": 1,
                     "model.transformer.ln_f": 1, "model.lm_head": 1}
    q = laid.declared.of("model.transformer.h.2.attn.q.weight")
    assert q.placement == lay.placement(1) and str(q.sbp) == str((graphc.sbp.broadcast, graphc.sbp.split(0)))
    assert str(laid.declared.of("model.transformer.h.0.mlp.proj.weight").sbp) == \
        str((graphc.sbp.broadcast, graphc.sbp.split(1)))
    assert (laid.gradient_accumulation_steps, laid.zero_stage) == (2, 1)
    assert Layout.from_json(lay.to_json()) == lay


def test_inputs_split_on_the_stage_that_reads_them():
    """idx is read by the embeddings on stage 0, the targets by the loss on the last stage:
    each is split over its own stage's data-parallel ranks."""
    graph = _graph()
    spec = graph._compile_spec()
    x, y = _batches(1)[0]
    lay = with_layers(Layout(pp=2, dp=2, microbatches=2), spec.root)
    stages = input_stages(spec, [x, y], lay)
    assert stages == [0, 1]
    laid = batch_layouts(lay, [x, y], [True, True], stages)
    assert [l.placement for l in laid] == [lay.placement(0), lay.placement(1)]


def test_stages_of_places_as_the_whole_compile_does():
    """compiler.stages_of (what input_stages runs: trace and place, no sharding or lowering)
    gives every node the stage a whole compile gives it, a V schedule's folded stages too."""
    from graphc.compiler import compile as compile_graph, stages_of
    from graphc.meta import META_STAGE
    graph = _graph()
    spec = graph._compile_spec()
    x, y = _batches(1)[0]
    laid = apply_layout(spec, with_layers(Layout(pp=2, schedule="zbv", microbatches=2), spec.root))
    placed = stages_of(laid, [x, y], 2)
    whole = compile_graph(laid, [x, y], 2).gm
    stage = {n.name: n.meta.get(META_STAGE) for n in placed.graph.nodes if n.op == "placeholder"}
    assert stage == {n.name: n.meta.get(META_STAGE) for n in whole.graph.nodes if n.op == "placeholder"}
    assert sorted(set(stage.values())) == [0, 3]


def test_a_model_that_fits_nothing_is_refused_with_the_memory_that_would_do():
    graph = _graph()
    spec = graph._compile_spec()
    x, y = _batches(1)[0]
    with pytest.raises(GraphcError, match=r"no layout on 4 ranks fits 0.00 GiB per rank \(the least estimated, "
                                          r".*, needs .* GiB by the memory model\)\. Fix: more ranks"):
        search(spec, [x, y], 4, [True, True], graph._optimizer, "h100", memory=1024, progress=False)


def _memory_model_peaks(compiled, optimizer):
    """Every rank's peak by the memory model (what graphc plan reports) of a CompiledGraph."""
    from graphc.tools.costs import device_costs
    from graphc.tools.simulate import memory_peak, model_inputs
    model, costs = model_inputs(compiled, optimizer), device_costs(compiled, "h100")
    return [memory_peak(p, model.params[p.rank], costs, batch=model.batch.get(p.rank, 0)).peak
            for p in compiled.plans]


def test_search_returns_a_layout_that_fits_by_the_memory_model_the_same_each_time():
    """At 300,000 bytes a rank the estimates of pp1 dp4 and pp2 dp2 fit and the memory model's
    peaks do not: the pipeline is tried next with checkpointing, scored on its own plans
    (NOTE: Memory check of the search), and what the search returns fits by the memory model,
    the same layout each time."""
    graph = _graph()
    spec = graph._compile_spec()
    x, y = _batches(1)[0]
    capacity = 300_000
    runs = [search(spec, [x, y], 4, [True, True], graph._optimizer, "h100", memory=capacity,
                   budget_s=None, top=3, progress=False) for _ in range(2)]
    assert runs[0].best.layout == runs[1].best.layout
    result, best = runs[0], runs[0].best
    assert [c.fits for c in result.tried] == [False, False, True]
    assert best.layout == replace(result.tried[1].layout, checkpointing="always")   # its twin
    # the winner's own compile (a twin scored on its sibling's plans is compiled when it wins)
    assert [p.checkpointing for p in result.compiled.plans] == ["always"] * 4
    assert max(_memory_model_peaks(result.compiled, graph._optimizer)) <= capacity
    report = result.report()
    assert best.layout.describe() in report and "**winner**" in report


def test_the_memory_check_skips_what_its_kind_predicts_too_big():
    """After a compile the memory model's ratio to the estimate scales its kind's later
    estimates (NOTE: Memory check of the search); another kind keeps its estimate."""
    from graphc.auto.fit import MemoryCheck
    from graphc.auto.search import Candidate
    check = MemoryCheck(capacity=1000)
    compiled = Candidate(Layout(pp=2, dp=2), est_step=1.0, est_memory=800, peak=1200)
    check.learn(compiled)
    same_kind, other_kind = Candidate(Layout(pp=4), 1.0, 700), Candidate(Layout(pp=4, tp=2), 1.0, 900)
    assert check.skips(same_kind) and "x 1.50" in same_kind.note          # 700 x 1.5 > 1000
    assert not check.skips(other_kind) and check.predicted(other_kind) == 900
    assert not check.skips(Candidate(Layout(pp=2, dp=2), 1.0, 600))      # 600 x 1.5 fits


LOADED = {
    "pp2xdp2_1f1b_zero1": Layout(pp=2, dp=2, microbatches=2, zero=1),
    "tp2xdp2_zero2": Layout(tp=2, dp=2, zero=2),
    "zbv_dp2": Layout(pp=2, dp=2, schedule="zbv", microbatches=2, checkpointing="always"),
}


# one layout by default (it also keeps checkpointing's recompute off the constants autograd
# saved: the GPT's positions, NOTE: Activation checkpointing); the others under -m slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "zbv_dp2" else pytest.mark.slow)
                                  for n in sorted(LOADED)])
def test_a_loaded_layout_trains_as_eager(name):
    """The Graph declares nothing; load_layout places it; each rank passes the whole batch."""
    data = _batches()
    layout = with_layers(LOADED[name], _graph()._compile_spec().root)

    def rank_main(rank):
        graph = _graph(layout)
        losses = [graph(x, y).to_local() for x, y in data]
        return [float(l) for l in losses if l.numel()], graph.full_state_dict(rank0_only=True)

    results = LocalWorld(layout.world).run(rank_main)
    eager = _gpt()
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    want = []
    for x, y in data:
        loss = lm_loss(eager(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        want.append(loss.item())
    losses = next(l for l, _ in results if l)
    for got, exp in zip(losses, want):
        assert_close(torch.tensor(got), torch.tensor(exp), f"{name}: loss")
    state = results[0][1]
    for k, v in eager.state_dict().items():
        assert_close(state[f"model.{k}"] if f"model.{k}" in state else state[k], v, f"{name}: {k}")


@pytest.mark.slow
def test_graphc_plan_auto_writes_a_layout_the_example_trains_on(tmp_path):
    """graphc plan examples/auto_layout.py --auto: layout.json, auto.md and the winner's plans;
    the example then trains on layout.json in a local world of its ranks."""
    from graphc.tools.plan_cli import parse, run_plan_command
    from auto_layout import main as example_main
    script = os.path.join(os.path.dirname(__file__), "..", "examples", "auto_layout.py")
    small = ["--layers", "4", "--embd", "16", "--heads", "2", "--block", "8", "--batch", "8"]
    args = parse([script, "--nproc", "4", "--out", str(tmp_path), "--auto", "--budget-s", "20",
                  "--no-chart", "--", *small])
    assert run_plan_command(args) == 0
    layout = Layout.load(str(tmp_path / "layout.json"))
    assert layout.world == 4 and (tmp_path / "auto.md").read_text().startswith("# Automatic layout")
    assert (tmp_path / "rank0.txt").exists()
    results = LocalWorld(4).run(lambda rank: example_main(["--layout", str(tmp_path / "layout.json"),
                                                           "--steps", "2", *small]))
    pairs = [p for r in results for p in r]
    assert len(pairs) >= 2
    for got, want in pairs:          # float64 (the tests' default dtype)
        assert_close(torch.tensor(got), torch.tensor(want), "the example on its auto layout")


def test_a_table_defined_after_the_layers_goes_to_the_first_stage():
    """HF Llama's `rotary_emb` (buffers, no parameters) is defined after `layers` and `norm`
    but feeds every layer: on the last stage the earlier stages would read a later one's
    value, and every pipeline of a Llama was refused."""
    from graphc.auto.layout import _outer_modules

    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.ones(4))

    class Body(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(5, 4)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
            self.norm = torch.nn.LayerNorm(4)
            self.rotary = Rotary()
    assert _outer_modules(Body(), "layers") == (["embed", "rotary"], ["norm"])
