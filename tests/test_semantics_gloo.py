"""The layout matrix's semantics on real processes (NOTE: Layout matrix): one user's program
with the habits issue 30 found trained silently wrong — a module-level global changed
between calls, a forward hook registered after the first call, a layer frozen with AdamW, a
loss divided by a count passed in, a correct-prediction count returned — run on gloo for two
representative layouts (data parallel 2 and pipeline 2), equal to eager on the whole batch
(float64, 1e-10). The local world runs the whole matrix (tests/test_frame_reads.py,
test_hooks.py, test_reductions.py); this checks the same holds across processes."""
import pytest
import torch

import graphc
from helpers import assert_close, run_world
from layouts import Pair, declare, feed

GAIN = 1.0
STEPS = 4


class Habits(Pair):
    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * GAIN


def _opt(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


class HabitGraph(graphc.Graph):
    def __init__(self, model, layout):
        super().__init__()
        self.model = model
        declare(self, layout)
        self.config.set_gradient_accumulation_steps(2)
        self.add_optimizer(_opt(model.parameters()))

    def build(self, x, y, n):
        out = self.model(x)
        loss = ((out - y) ** 2).sum() / n
        loss.backward()
        return loss, (out.argmax(-1) == y.argmax(-1)).sum()


def _between(model, step):
    global GAIN
    if step == 1:
        GAIN = 1.5
        model.b.register_forward_hook(lambda module, args, out: out * 0.5)
    if step == 2:
        model.a.requires_grad_(False)


def _batches():
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)
        out.append((x, y, torch.tensor(float(y.numel()))))
    return out


def _eager():
    global GAIN
    GAIN = 1.0
    torch.manual_seed(0)
    model = Habits()
    opt = _opt(model.parameters())
    losses, counts = [], []
    for step, (x, y, n) in enumerate(_batches()):
        _between(model, step)
        out = model(x)
        loss = ((out - y) ** 2).sum() / n
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        counts.append(int((out.argmax(-1) == y.argmax(-1)).sum()))
    return losses, counts, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank(rank, world, layout):
    global GAIN
    GAIN = 1.0
    torch.manual_seed(0)
    model = Habits()
    graph = HabitGraph(model, layout)
    args = feed(layout, _batches())
    losses, counts = [], []
    for step in range(STEPS):
        _between(model, step)
        loss, correct = graph(*(args(rank, step) if callable(args) else args[step]))
        if loss.to_local().numel():
            losses.append(float(loss.to_local()))
            counts.append((int(correct.to_local()), correct.to_local().dtype))
    return losses, counts, graph.full_state_dict(), len(graph.recompiles)


@pytest.mark.world
@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_a_users_habits_on_gloo_equal_eager(layout):
    want_losses, want_counts, want_state = _eager()
    for rank, (losses, counts, state, recompiles) in enumerate(run_world(_rank, 2, layout)):
        assert recompiles == 2   # the global and the hook at step 1, the frozen layer at step 2
        if not losses:   # pp2's first rank holds no loss
            continue
        assert_close(torch.tensor(losses), torch.tensor(want_losses), f"{layout} rank {rank} losses")
        assert [c for c, _ in counts] == want_counts, (counts, want_counts)
        assert all(dtype == torch.int64 for _, dtype in counts)
        for k, v in want_state.items():
            assert_close(state[k], v, f"{layout} rank {rank}: {k}")
