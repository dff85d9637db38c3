"""config.set_memory_stats: activation bytes are counted (a Python hook on every tensor
autograd saves) only when asked for (issue 38 item 2); the live micro-batch count always."""
import torch
import torch.nn as nn

import graphc


class Step(graphc.Graph):
    def __init__(self, model, stats: bool):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(2)
        if stats:
            self.config.set_memory_stats(True)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, x):
        loss = self.model(x).square().mean()
        loss.backward()
        return loss


def test_bytes_counted_only_when_asked_for(monkeypatch):
    hooks = []
    real = torch.autograd.graph.saved_tensors_hooks
    monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks",
                        lambda *a: hooks.append(a) or real(*a))
    x = torch.randn(8, 16)
    quiet, counted = Step(nn.Sequential(nn.Linear(16, 32), nn.Tanh()), False), \
        Step(nn.Sequential(nn.Linear(16, 32), nn.Tanh()), True)
    quiet(x)
    assert hooks == [] and quiet.last_stats.max_live_bytes == {}
    assert quiet.last_stats.max_live_activations == {0: 1}
    counted(x)
    assert len(hooks) == 2   # one per micro-batch's forward
    # one micro-batch live at a time: Linear saves its input, a view of the whole batch's
    # storage (8 x 16, counted by storage), and tanh its output (4 x 32); float64
    assert counted.last_stats.max_live_bytes == {0: (8 * 16 + 4 * 32) * 8}
