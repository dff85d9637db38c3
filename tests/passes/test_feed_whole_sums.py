"""feed_whole_sums: sums over the batch without gradient that a loss combines nonlinearly (a
router's token counts, a mask's count) take the whole batch's value from a pre-pass, so the
step equals eager on the whole batch (float64, 1e-10) under accumulation; one process.
Hugging Face MoE models on expert-parallel layouts: tests/examples/test_hub_experts.py."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from helpers import assert_close

B, D, E, K = 8, 6, 4, 2


class Router(nn.Module):
    """A tiny mixture: a linear router picking K of E experts (each a Linear), and its logits."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gate, self.experts = nn.Linear(D, E, bias=False), nn.Linear(D, E * D)

    def forward(self, x):
        logits = self.gate(x)
        weights, chosen = torch.topk(torch.softmax(logits, -1), K, dim=-1)
        outs = self.experts(x).view(-1, E, D)
        return (outs.gather(1, chosen[..., None].expand(-1, -1, D)) * weights[..., None]).sum(1), logits


def switch_loss(logits):
    """Switch Transformer's aux loss as transformers writes it: E * sum_e f_e * P_e."""
    probs = torch.softmax(logits, -1)
    _, chosen = torch.topk(probs, K, dim=-1)
    counts = torch.histc(chosen.reshape(-1).to(probs.dtype), bins=E, min=0, max=E)
    return E * torch.sum((counts / logits.shape[0]) * (probs.sum(0) / logits.shape[0]))


def masked_switch_loss(logits, mask):
    """The same with a padding mask, as transformers' masked branch: the counts scattered in
    place into zeros, the rows counted by the mask (three sums without gradient)."""
    probs = torch.softmax(logits, -1)
    _, chosen = torch.topk(probs, K, dim=-1)
    flat = mask.reshape(-1).to(probs.dtype)
    counts = torch.zeros(E, dtype=probs.dtype).scatter_add_(0, chosen.reshape(-1), flat.repeat_interleave(K))
    rows = flat.sum()
    return E * torch.sum((counts / rows) * ((probs * flat[:, None]).sum(0) / rows))


def routed_masked(model, x, y, mask):
    out, logits = model(x)
    return F.mse_loss(out, y) + 0.5 * masked_switch_loss(logits, mask)


def routed(model, x, y, mask):
    out, logits = model(x)
    return F.mse_loss(out, y) + 0.5 * switch_loss(logits)


def masked_mean(model, x, y, mask):
    per_row = (model(x)[0] - y).pow(2).sum(1)
    return (per_row * mask).sum() / mask.sum()


class LossGraph(graphc.Graph):
    def __init__(self, fn, model, accumulation):
        super().__init__()
        self.model, self.fn = model, fn
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))

    def build(self, x, y, mask):
        loss = self.fn(self.model, x, y, mask)
        loss.backward()
        return loss


def _batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(B, D, generator=g), torch.randn(B, D, generator=g),
             (torch.rand(B, generator=g) > 0.3).double()) for _ in range(2)]


def _eager(fn):
    model = Router()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for batch in _batches():
        loss = fn(model, *batch)
        opt.zero_grad(), loss.backward(), opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize("fn, accumulation", [(routed_masked, 2), pytest.param(routed, 2, marks=pytest.mark.slow),
                                              pytest.param(routed, 4, marks=pytest.mark.slow),
                                              pytest.param(masked_mean, 4, marks=pytest.mark.slow)])
def test_whole_batch_sums_equal_eager_under_accumulation(fn, accumulation, capsys):
    """Each micro-batch reads the whole batch's counts (the pre-pass, said once at compile),
    and the steps equal eager's on the whole batch: losses and parameters at 1e-10."""
    model = Router()
    graph = LossGraph(fn, model, accumulation)
    capsys.readouterr()
    losses = [graph(*batch).to_local().item() for batch in _batches()]
    said = capsys.readouterr().err
    want_losses, want_state = _eager(fn)
    assert_close(torch.tensor(losses), torch.tensor(want_losses), "losses")
    for k, v in want_state.items():
        assert_close(model.state_dict()[k], v, k)
    assert "a pre-pass runs" in said and "one extra forward" in said and "test_feed_whole_sums.py" in said
    prologue = graph.compiled.programs[0].prologue
    assert prologue is not None and all(o.startswith("graphc_whole_") for o in prologue.outputs)


def test_a_sum_with_a_gradient_combined_nonlinearly_is_still_refused():
    """Only sums without gradient can take the whole batch's value: the mean of x times the
    mean of x (both carrying the gradient) per micro-batch is another function."""
    def squared_mean(model, x, y, mask):
        m = model(x)[0].mean()
        return m * m
    graph = LossGraph(squared_mean, Router(), 2)
    with pytest.raises(graphc.GraphcError, match=r"two sums or means over the batch are multiplied"):
        graph(*_batches()[0])


def test_zero3_gathers_the_parameters_before_the_pre_pass():
    """ZeRO stage 3 on data 2 (the local world): the pre-pass is the stage's first compute
    (0P0), so the whole-stage gather comes before it and the pre-pass reads the parameters
    the step reads; the steps equal eager's at 1e-10 (See NOTE: Whole-batch sums)."""
    from graphc.plan.instructions import AllGather, PrePass
    from graphc.runtime.local_world import LocalWorld
    from helpers import global_input
    p01, s0 = graphc.placement("cpu", [0, 1]), graphc.sbp.split(0)

    def rank_main(rank: int):
        model = Router()
        graphc.to_global(model, placement=p01, sbp=graphc.sbp.broadcast)
        graph = LossGraph(routed, model, 2)
        graph.config.enable_zero(True, stage=3, shard_min_size=1)
        losses = [graph(*(global_input(t, p01, s0, rank) for t in batch)).to_local().item()
                  for batch in _batches()]
        return losses, graph.full_state_dict(rank0_only=True), graph.plan
    (losses, state, plan), _ = LocalWorld(2).run(rank_main)
    kinds = [type(ins) for ins in plan.instructions]
    assert kinds[:3] == [AllGather, PrePass, PrePass], str(plan)
    want_losses, want_state = _eager(routed)
    assert_close(torch.tensor(losses), torch.tensor(want_losses), "losses")
    for k, v in want_state.items():
        assert_close(state[k], v, k)
