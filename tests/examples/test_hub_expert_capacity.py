"""Expert parallelism at a fixed capacity (self.config.set_expert_capacity; See NOTE: Expert
capacity, graphc/ops/expert_capacity.py): Mixtral on ep2, against its own oracle, eager
PyTorch on the whole batch with the same drops (each rank's micro-batch, per expert its
first C token-slot pairs kept), float64 at 1e-10. Layouts and helpers: test_hub_experts.py."""
import math
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

import graphc
from graphc.plan.instructions import Collective
from graphc.runtime.local_world import LocalWorld
from helpers import assert_close
from test_hub_experts import LOSS_RTOL, MoEGraph, batches, local_inputs, model_of

pytest.importorskip("transformers")


def kept(ids: torch.Tensor, experts: int, factor: float) -> torch.Tensor:
    """1 for each pair of ids [tokens, k] within its expert's first C = ceil(factor * pairs / E)
    pairs (in token, then slot, order), else 0."""
    flat = F.one_hot(ids.reshape(-1), experts)
    capacity = math.ceil(factor * ids.numel() / experts)
    position = (flat.cumsum(0) * flat).sum(1)                             # 1-based in its expert
    return (position <= capacity).reshape(ids.shape)


@contextmanager
def eager_drops(model, parts: int, factor: float, dropped: list):
    """The eager model's experts drop as the capacity does, on its tokens cut into `parts`
    consecutive pieces (the ranks' micro-batches in order); `dropped` collects the counts."""
    layers = [layer.mlp.experts for layer in model.model.layers]
    for experts in layers:
        def forward(hidden, top_k_index, top_k_weights, original=experts.forward, e=experts.num_experts):
            keep = torch.cat([kept(ids, e, factor) for ids in top_k_index.chunk(parts)])
            dropped.append(int((keep == 0).sum()))
            return original(hidden, top_k_index, top_k_weights * keep.to(top_k_weights.dtype))
        experts.forward = forward
    try:
        yield
    finally:
        for experts in layers:
            del experts.forward


def train_at_capacity(factor: float, data, accumulation: int = 2):
    def rank_main(rank: int):
        model = model_of("mixtral", aux=False)
        graph = MoEGraph(model, "ep2", accumulation, torch.optim.SGD(model.parameters(), lr=0.1))
        graph.config.set_expert_capacity(factor)
        losses = [graph(*local_inputs("ep2", rank, *d)).to_local().item() for d in data]
        return losses, graph, graph.full_state_dict(rank0_only=True)
    return LocalWorld(2).run(rank_main)


@pytest.mark.slow
def test_mixtral_ep2_at_capacity_equals_eager_with_the_same_drops():
    """Capacity 1.0 drops pairs (counted in the oracle), and graphc's steps equal eager's with
    those drops: losses at 8 float32 eps (the causal LM's own loss upcasts), parameters at
    1e-10. The plan lists 2 exchanges per layer and micro-batch each way, no counts."""
    data, factor = batches(), 1.0
    results = train_at_capacity(factor, data)
    model, dropped = model_of("mixtral", aux=False), []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    with eager_drops(model, 4, factor, dropped):
        for ids, labels in data:
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad(), loss.backward(), opt.step()
            want.append(loss.item())
    assert sum(dropped) > 0, dropped
    torch.testing.assert_close(torch.tensor(results[0][0]), torch.tensor(want), rtol=LOSS_RTOL, atol=0)
    for k, v in model.state_dict().items():
        assert_close(results[0][2][k], v, f"capacity {factor}: {k}")
    plan = results[0][1].compiled.plans[0]
    notes = [ins.note for ins in plan.instructions if isinstance(ins, Collective) and ins.microbatch == 0
             and "expert parallel" in ins.note]
    assert len(notes) == 8 and not any("counts" in n for n in notes), notes
    assert all(n.endswith("(capacity 1)") for n in notes), notes


@pytest.mark.parametrize("factor", [0, -1.0, True, "1.25"])
def test_a_capacity_that_is_not_a_positive_number_is_refused(factor):
    graph = graphc.Graph()
    with pytest.raises(graphc.GraphcError, match=r"set_expert_capacity: factor must be a number > 0"):
        graph.config.set_expert_capacity(factor)


@pytest.mark.slow
def test_a_capacity_without_expert_parallel_runs_dropless_and_says_so(monkeypatch):
    """set_expert_capacity acts on experts split over ranks; with the experts broadcast (plain
    data parallel) the layers stay dropless, as eager is, and the compile says the option has
    no effect instead of leaving the user to believe tokens are dropped."""
    from test_hub_experts import BC, EPLayout, LAYOUTS, P01, S0
    from helpers import compile_graph, global_input
    monkeypatch.setitem(LAYOUTS, "dp2", EPLayout(2, ((0, 1),), (BC,), (S0,)))
    graph = MoEGraph(model_of("mixtral", aux=False), "dp2")
    graph.config.set_expert_capacity(1.0)
    with pytest.warns(UserWarning, match="set_expert_capacity has no effect here"):
        compiled = compile_graph(graph, [global_input(t, P01, S0) for t in batches(1)[0]], 2)
    notes = [getattr(ins, "note", "") for ins in compiled.plans[0].instructions]
    assert not any("expert parallel" in n for n in notes), notes
