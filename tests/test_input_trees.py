"""build() takes nested dicts, lists and tuples of tensors and returns any structure, a
Hugging Face ModelOutput as itself (NOTE: Input trees, graphc/executable.py; NOTE: Output
trees, graphc/passes/trace_build.py): a Hugging Face training loop's `build(self, batch)`
with `self.model(**batch)`, against eager PyTorch on the whole batch in float64 (1e-10)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from helpers import assert_close, run_world
from layouts import Pair, assert_same, declare, train


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stage0 = nn.Linear(6, 8)
        self.stage1 = nn.Linear(8, 3)

    def forward(self, x, shift):
        return self.stage1(torch.tanh(self.stage0(x) + shift))


class NestedGraph(graphc.Graph):
    def __init__(self, model, opt, m=2, pipeline=False):
        super().__init__()
        self.model = model
        if pipeline:
            self.model.stage0.config.set_stage(0, graphc.placement("cpu", [0]))
            self.model.stage1.config.set_stage(1, graphc.placement("cpu", [1]))
        self.config.set_gradient_accumulation_steps(m)
        self.add_optimizer(opt)

    def build(self, batch, extras):
        logits = self.model(batch["x"], extras[0]["shift"])
        loss = F.cross_entropy(logits, batch["y"])
        loss.backward()
        return {"loss": loss, "parts": [logits, loss.detach() * 2]}


def _batch():
    g = torch.Generator().manual_seed(0)
    return ({"x": torch.randn(8, 6, generator=g), "y": torch.randint(0, 3, (8,), generator=g)},
            [{"shift": torch.randn(8, 8, generator=g)}])


def _eager(model, batch, extras, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        logits = model(batch["x"], extras[0]["shift"])
        loss = F.cross_entropy(logits, batch["y"])
        opt.zero_grad(), loss.backward(), opt.step()
        losses.append(loss.detach())
    return losses, logits.detach(), model.state_dict()


def test_nested_inputs_and_outputs_train_like_eager():
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    graph = NestedGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch, extras = _batch()
    outs = [graph(batch, extras) for _ in range(2)]
    want_losses, want_logits, want_state = _eager(ref, batch, extras)
    assert set(outs[-1]) == {"loss", "parts"} and len(outs[-1]["parts"]) == 2
    for out, want in zip(outs, want_losses):
        assert_close(out["loss"].to_local(), want, "loss")
    assert outs[-1]["parts"][0].to_local().shape == want_logits.shape  # rows merged over micro-batches
    assert_close(outs[-1]["parts"][0].to_local(), want_logits, "logits (a list's leaf)")
    assert_close(outs[0]["parts"][1].to_local(), 2 * want_losses[0], "a list's leaf")
    for k, v in want_state.items():
        assert_close(model.state_dict()[k], v, k)
    # the shift rows are split with the batch: its leaf name is its key path
    assert "extras_0_shift" in graph.compiled.gm.code


def _pipeline_worker(rank, world):
    torch.manual_seed(0)
    model = Net()
    graph = NestedGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), pipeline=True)
    batch, extras = _batch()
    losses = [graph(batch, extras)["loss"].to_local().clone() for _ in range(2)]
    return losses, {k: v.clone() for k, v in graph.full_state_dict().items()}


@pytest.mark.world
@pytest.mark.slow   # CI time: dict batches on pp2 run in the layout matrix's local world (tests/test_side_effects.py, tests/layouts.py feed)
def test_nested_inputs_on_a_pipeline_train_like_eager():
    torch.manual_seed(0)
    want_losses, _, want_state = _eager(Net(), *_batch())
    results = run_world(_pipeline_worker, 2)
    assert any(r[0][0].numel() for r in results)
    for losses, state in results:
        for got, want in zip(losses, want_losses):
            if got.numel():
                assert_close(got, want, "loss")
        for k, v in want_state.items():
            assert_close(state[k], v, k)


transformers = pytest.importorskip("transformers")


def _llama(use_cache=False):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=use_cache)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


class HFGraph(graphc.Graph):
    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(2)
        self.add_optimizer(opt)

    def build(self, batch):
        out = self.model(**batch)
        out.loss.backward()
        return out


def _hf_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (4, 8), generator=g)
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[1, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_hugging_face_dict_batch_returns_its_model_output():
    model = _llama()
    ref = copy.deepcopy(model)
    graph = HFGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    batch = _hf_batch()
    for _ in range(2):
        out = graph(batch)
        want = ref(**batch)
        opt.zero_grad(), want.loss.backward(), opt.step()
        assert type(out) is type(want) and list(out.keys()) == ["loss", "logits"]
        assert_close(out.logits.to_local(), want.logits.detach(), "logits")
    for k, v in ref.state_dict().items():
        assert_close(model.state_dict()[k], v, k)


def test_a_returned_python_object_is_refused():
    """use_cache=True puts a DynamicCache made while tracing into the ModelOutput."""
    model = _llama(use_cache=True)
    graph = HFGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(graphc.GraphcError, match=r"returns a DynamicCache at .*use_cache=False"):
        graph(_hf_batch())


# -- a new key set is a new input signature (issue 30, row 10) --------------------------------
class KeyedGraph(graphc.Graph):
    """build(self, batch) where some batches carry a "mask" and others do not."""

    def __init__(self, model, layout):
        super().__init__()
        self.model = model
        declare(self, layout)
        self.config.set_gradient_accumulation_steps(2)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, batch):
        loss = _keyed_loss(self.model, batch)
        loss.backward()
        return loss


def _keyed_loss(model, batch):
    err = (model(batch["x"]) - batch["y"]) ** 2
    return (err * batch["mask"]).mean() if "mask" in batch else err.mean()


def _keyed_batches(steps=4):
    """Alternating key sets: {x, y}, then {x, mask, y} (the mask in the middle: a new tree,
    not only a new last leaf), and so on."""
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)
        mask = (torch.rand(8, 4, generator=g) > 0.3).to(x.dtype)
        out.append(({"x": x, "mask": mask, "y": y} if step % 2 else {"x": x, "y": y},))
    return out


@pytest.mark.parametrize("layout", ["one", "pp2", "dp2", "zero3"])
def test_a_batch_with_a_new_key_set_gets_its_own_plan(layout):
    batches = _keyed_batches()
    torch.manual_seed(0)
    ref = Pair()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want_losses = []
    for (batch,) in batches:
        loss = _keyed_loss(ref, batch)
        opt.zero_grad(), loss.backward(), opt.step()
        want_losses.append(loss.item())
    graphs = []

    def make_graph(layout):
        torch.manual_seed(0)
        graphs.append(KeyedGraph(Pair(), layout))
        return graphs[-1]

    got = train(layout, make_graph, batches)
    assert_same(got, (want_losses, ref.state_dict()), layout)
    for graph in graphs:  # one compile per key set, reused when the first key set comes back
        assert len(graph._cache) == 2, graph.recompiles
        assert graph.recompiles == ["the inputs' structure is new (batch_x, batch_mask, batch_y)"]


def test_a_new_key_set_of_another_rank_is_still_refused():
    """Within one input structure, a leaf's number of dims is part of the program."""
    torch.manual_seed(0)
    graph = KeyedGraph(Pair(), "one")
    (batch,) = _keyed_batches(1)[0]
    graph(batch)
    graph({"x": batch["x"], "mask": batch["y"], "y": batch["y"]})
    with pytest.raises(graphc.GraphcError, match=r"input 1 of KeyedGraph has shape \[8, 4, 1\]"):
        graph({"x": batch["x"], "mask": batch["y"][..., None], "y": batch["y"]})
