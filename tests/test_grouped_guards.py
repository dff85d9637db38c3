"""The grouped guard check (NOTE: Grouped guard check, graphc/guards/values.py) says "all
hold" exactly when the one-by-one check does, for every kind of guard it groups: a child
module or parameter replaced, a plain setting (bool, number, tuple of numbers) changed, a
class attribute shadowed or changed, a hook registered (NOTE: Hook registrations counted),
requires_grad flipped. Then GuardSet.failing() names the guard that failed."""
import pytest
import torch
import torch.nn as nn

import graphc
from graphc.guards.values import grouped_check, sequential_check


class Config:
    """A small settings object (as an HF config): guarded by its attributes, through an
    object matcher (NOTE: Object matchers)."""

    def __init__(self):
        self.gain = 1.5
        self.act = "relu"
        self.id2label = {0: "a", 1: "b"}
        self.rope = {"theta": 1e4, "kind": None}


class Gain(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, x):
        return x * self.config.gain


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.scale = 2.0
        self.config = Config()
        self.gain = Gain(self.config)        # the same config read by two modules
        self.offset = torch.zeros(4)         # a plain tensor attribute: guarded by identity

    def forward(self, x):
        out = self.gain(self.norm(self.lin(x)) * self.scale * self.config.gain) + self.offset
        return out if self.training else out.detach()


class Step(graphc.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, x):
        loss = self.model(x).square().mean()
        loss.backward()
        return loss


def _replace_linear(m):
    m.lin = nn.Linear(4, 4)


def _replace_weight(m):
    m.lin.weight = nn.Parameter(m.lin.weight.detach().clone())


def _shadow_class_attribute(m):
    m.lin._compiled_call_impl = lambda *a, **k: None   # what module.compile() sets


CHANGES = {
    "module replaced": (_replace_linear, "model.lin"),
    "parameter replaced": (_replace_weight, "model.lin.weight"),
    "float setting": (lambda m: setattr(m, "scale", 3.0), "model.scale"),
    "float setting to an int": (lambda m: setattr(m, "scale", 2), "model.scale"),
    "tuple setting": (lambda m: setattr(m.norm, "normalized_shape", (4.0,)), "model.norm.normalized_shape"),
    "eps": (lambda m: setattr(m.norm, "eps", 1e-3), "model.norm.eps"),
    "training flag": (lambda m: m.eval(), "model.training"),
    "class attribute shadowed": (_shadow_class_attribute, "model.lin._compiled_call_impl"),
    "forward hook": (lambda m: m.lin.register_forward_hook(lambda *a: None), "module hooks"),
    "requires_grad": (lambda m: m.lin.bias.requires_grad_(False), "requires_grad of the parameters"),
    "config setting": (lambda m: setattr(m.config, "gain", 2.5), "model.config"),
    "config setting's type": (lambda m: setattr(m.config, "act", b"relu"), "model.config"),
    "config dict entry": (lambda m: m.config.id2label.update({1: "c"}), "model.config"),
    "config nested value": (lambda m: m.config.rope.update(kind="linear"), "model.config"),
    "config attribute added": (lambda m: setattr(m.config, "extra", 1), "model.config"),
    "config of one reader": (lambda m: setattr(m.gain, "config", _changed_copy(m.config)), "model.gain.config"),
    "tensor attribute": (lambda m: setattr(m, "offset", torch.zeros(4)), "model.offset"),
}


def _changed_copy(config):
    other = Config()
    other.gain = config.gain + 1
    return other


@pytest.mark.parametrize("change", list(CHANGES))
def test_grouped_check_agrees_with_the_one_by_one_check(change):
    model = Net()
    graph = Step(model)
    graph.compile(torch.randn(2, 4))
    guards = graph.compiled.guards
    assert len(guards) > 10
    fast, every = grouped_check(guards.guards), sequential_check(guards.guards)
    assert fast({}) is True and every({}) == -1 and guards.failing() is None
    mutate, where = CHANGES[change]
    mutate(model)
    assert fast({}) is False
    failed = guards.failing()
    assert failed is not None and failed.where.startswith(where), (failed and failed.where)


def test_an_equal_config_object_still_holds():
    """A config replaced by an equal copy fingerprints alike: the object matcher (built for
    the first object) does not match it by identity, and the check still says all hold."""
    model = Net()
    graph = Step(model)
    graph.compile(torch.randn(2, 4))
    model.gain.config = Config()
    assert grouped_check(graph.compiled.guards.guards)({}) is True and graph.compiled.guards.failing() is None


def test_autocast_state_is_checked_inline():
    model = Net()
    graph = Step(model)
    graph.compile(torch.randn(2, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        failed = graph.compiled.guards.failing()
    assert failed is not None and failed.where == "autocast state (cpu)"
    assert graph.compiled.guards.failing() is None
