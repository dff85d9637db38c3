"""A real peft LoRA model, as a user fine-tunes one, against eager peft (float64, 1e-10):
- its LoRA layers read a property (`active_adapters`) in every forward: one plan for every
  call with the same input shapes (a property's guard failed on every call, 60-100x slower);
- two adapters switched with `set_adapter` every call both train as in eager: the switch
  changes which parameters take gradients and which branch the forward takes, so each adapter
  gets its own cached plan, and the adapter the first plan left out joins the optimizer when
  its plan first runs (NOTE: Guards; GraphState.adopt).
Run on one process, data parallel 2 and pipeline 2 in the local world."""
import pytest
import torch
import torch.nn as nn

import graphc
from layouts import assert_same, batches, eager, train

peft = pytest.importorskip("peft")


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _lora():
    return peft.LoraConfig(r=2, lora_alpha=4, target_modules=["a", "b"], init_lora_weights=False)


def make_model():
    torch.manual_seed(0)
    model = peft.get_peft_model(Base(), _lora(), adapter_name="one")
    model.add_adapter("two", _lora())
    return model


def _opt(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)


class LoraGraph(graphc.Graph):
    def __init__(self, model, layout):
        super().__init__()
        self.model = model
        inner = self.model.base_model.model
        if layout == "dp2":
            self.model.config.set_stage(0, graphc.placement("cpu", [0, 1]))
        elif layout == "pp2":
            inner.a.config.set_stage(0, graphc.placement("cpu", [0]))
            inner.b.config.set_stage(1, graphc.placement("cpu", [1]))
        self.config.set_gradient_accumulation_steps(2)
        self.add_optimizer(_opt(model.parameters()))

    def build(self, x, y):
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        return loss


def _run(layout, data, switch):
    graphs = []
    got = train(layout, lambda layout: LoraGraph(make_model(), layout), data,
                between=lambda graph, step: switch(graph.model.origin, step), graphs=graphs)
    assert_same(got, eager(make_model(), data, _opt, switch), layout)
    return graphs


def test_one_plan_for_twenty_calls():
    graphs = _run("one", batches(20), lambda model, step: None)
    assert graphs[0].recompiles == []


@pytest.mark.parametrize("layout", ["one", "dp2", "pp2"])
def test_two_adapters_switched_every_call_both_train_as_in_eager(layout):
    graphs = _run(layout, batches(6), lambda model, step: model.set_adapter(("one", "two")[step % 2]))
    for graph in graphs:   # a plan per adapter, each reused after its first call
        assert len(graph.recompiles) == 1, graph.recompiles
        assert "lora_A.two.weight trainable" in graph.recompiles[0]
