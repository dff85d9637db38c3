"""`with torch.autocast(...)` inside build() and in a module's forward mean what they mean in
eager (NOTE: Autocast regions): never dropped. CPU autocast to bfloat16 is deterministic, so
graphc equals eager running the same regions bit for bit (one process, float32 parameters)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc

pytestmark = pytest.mark.fp32


class Net(nn.Module):
    def __init__(self, inner_autocast=False):
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.l2 = nn.Linear(16, 4)
        self.inner_autocast = inner_autocast

    def forward(self, x):
        if self.inner_autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = torch.relu(self.l1(x))
        else:
            h = torch.relu(self.l1(x))
        return self.l2(h)


class AmpGraph(graphc.Graph):
    def __init__(self, model, opt, m=1):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(m)
        self.add_optimizer(opt)

    def build(self, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = self.model(x)
        loss = F.cross_entropy(out.float(), y)
        loss.backward()
        return loss, out


def _eager(model, opt, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    loss = F.cross_entropy(out.float(), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach(), out.detach()


@pytest.mark.parametrize("inner", [False, True])
def test_autocast_region_in_build_equals_eager_bitwise(inner):
    torch.manual_seed(0)
    model = Net(inner)
    ref = copy.deepcopy(model)
    graph = AmpGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        loss, out = graph(x, y)
        want_loss, want_out = _eager(ref, opt, x, y)
        assert out.to_local().dtype == torch.bfloat16  # the region was honoured, not dropped
        assert torch.equal(out.to_local(), want_out), step
        assert torch.equal(loss.to_local(), want_loss), step
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert not torch.is_autocast_enabled("cpu")  # the program left its region


def test_autocast_region_is_printed_in_the_stage_program():
    torch.manual_seed(0)
    model = Net()
    graph = AmpGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    graph.compile(torch.randn(8, 8), torch.randint(0, 4, (8,)))
    text = str(graph)
    assert "set_autocast((('cpu', 'bfloat16'),))" in text
    assert "set_autocast(())" in text
    assert "bf16" in text or "bfloat16" in text


class ScalerGraph(graphc.Graph):
    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.scaler = torch.amp.GradScaler("cpu")
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        self.scaler.scale(loss).backward()
        return loss


def test_grad_scaler_in_build_is_refused_as_amp():
    """Traced, scale(loss).backward() trained on gradients 65536 times too large, silently."""
    model = Net()
    graph = ScalerGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(graphc.GraphcError, match=r"GradScaler.scale\(\) at .*test_autocast_regions.py:\d+.*"
                                                 r"automatic mixed precision"):
        graph(torch.randn(8, 8), torch.randint(0, 4, (8,)))
