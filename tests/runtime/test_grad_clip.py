"""config.set_grad_clip_norm equals eager's clip_grad_norm_ on the whole model.

The norm is global: over every stage (pipeline 2, also with a weight tied across the two
stages, counted once) and over every shard and replica
(data 2 x tensor 2 on a 2-D mesh, where replicated parameters count once and split ones
by their shards). max_norm is small enough that every step clips (checked on the eager
side), so a wrong norm shows as a wrong step. Float64, tolerance 1e-10 (helpers.py).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc import sbp
from graphc.compiler import compile as compile_graph
from graphc.plan.instructions import ClipGradNorm, instruction_from_json, parse_instruction
from helpers import assert_same_as_eager, feed_split, graphc_train, run_world
from models import PipelineGraph, SkipNet, make_batches
from transformer_models import GPTGraph, TinyGPT, token_batches, token_loss

MAX_NORM = 0.05
STEPS = 3
D, CLASSES = 8, 5


class MLP(nn.Module):
    """fc1 column-parallel and fc2 row-parallel under megatron(); norm and head replicated."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, CLASSES)

    def forward(self, x):
        return self.head(self.norm(x + self.fc2(F.gelu(self.fc1(x)))))


class ClipGraph(graphc.Graph):
    def __init__(self, model, opt, accumulation):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(accumulation)
        self.config.set_grad_clip_norm(MAX_NORM)
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


class ClipPipeline(PipelineGraph):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.config.set_grad_clip_norm(MAX_NORM)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _mesh_layout(model):
    mesh = graphc.placement("cpu", [[0, 1], [2, 3]])  # axis 0: data, axis 1: tensor
    graphc.to_global(model, placement=mesh, sbp=(sbp.broadcast, sbp.broadcast))
    graphc.to_global(model.fc1, placement=mesh, sbp=(sbp.broadcast, sbp.split(0)))
    graphc.to_global(model.fc2.weight, placement=mesh, sbp=(sbp.broadcast, sbp.split(1)))
    return mesh


def _eager(model, batches, loss_fn):
    """The oracle: eager steps with clip_grad_norm_; also checks that every step clipped."""
    opt = _sgd(model.parameters())
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        assert norm > 2 * MAX_NORM, f"eager norm {norm} does not clip; lower MAX_NORM"
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


class ClipGPT(GPTGraph):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.config.set_grad_clip_norm(MAX_NORM)


def _train_pipeline(rank, world):
    torch.manual_seed(0)
    model = SkipNet(2)
    graph = ClipPipeline(model, _sgd(model.parameters()), accumulation=2)
    losses, state = graphc_train(graph, make_batches(STEPS))
    torch.manual_seed(0)
    gpt = TinyGPT()  # wte tied to lm_head: held by stage 0 and stage 1, counted once
    stages = [graphc.placement("cpu", [0]), graphc.placement("cpu", [1])]
    gpt_graph = ClipGPT(gpt, _sgd(gpt.parameters()), stages, accumulation=2)
    gpt_losses, gpt_state = graphc_train(gpt_graph, token_batches(STEPS))
    return {"losses": losses, "state": state, "plan": graph.plan, "gpt_losses": gpt_losses,
            "gpt_state": gpt_state}


def _train_data_tensor(rank, world):
    torch.manual_seed(0)
    model = MLP()
    mesh = _mesh_layout(model)
    graph = ClipGraph(model, _sgd(model.parameters()), accumulation=2)
    # rows split on the mesh's data axis: rank r passes data row r // 2
    losses, state = graphc_train(graph, make_batches(STEPS, batch=16, d=D, classes=CLASSES),
                                 feed=feed_split(mesh, rank, (sbp.split(0), sbp.broadcast)))
    return {"losses": losses, "state": state, "plan": graph.plan}


@pytest.mark.world
def test_grad_clip_pipeline_matches_eager():
    results = run_world(_train_pipeline, 2)
    torch.manual_seed(0)
    ref_losses, ref_state = _eager(SkipNet(2), make_batches(STEPS), nn.CrossEntropyLoss())
    assert_same_as_eager(results[1]["losses"], results[1]["state"], ref_losses, ref_state,
                         "pipeline 2, accumulation 2, clipped")
    assert_same_as_eager([], results[0]["state"], [], ref_state, "pipeline rank 0")
    clips = [[i for i in r["plan"].instructions if isinstance(i, ClipGradNorm)] for r in results]
    assert [len(c) for c in clips] == [1, 1] and clips[0][0] == clips[1][0]
    torch.manual_seed(0)
    ref_losses, ref_state = _eager(TinyGPT(), token_batches(STEPS), token_loss)
    assert_same_as_eager(results[1]["gpt_losses"], results[1]["gpt_state"], ref_losses, ref_state,
                         "tied GPT, pipeline 2, accumulation 2, clipped")


@pytest.mark.world
@pytest.mark.slow   # CI time: clipping on a pipeline and the sweep's tp layouts run by default
def test_grad_clip_data_x_tensor_matches_eager():
    results = run_world(_train_data_tensor, 4)
    torch.manual_seed(0)
    ref_losses, ref_state = _eager(MLP(), make_batches(STEPS, batch=16, d=D, classes=CLASSES),
                                   nn.CrossEntropyLoss())
    for rank, res in enumerate(results):
        assert_same_as_eager(res["losses"], res["state"], ref_losses, ref_state,
                             f"data 2 x tensor 2, rank {rank}")


def test_each_gradient_counted_once_and_plan_round_trips():
    """Plan level, no processes: over the 4 ranks, every parameter's shards are counted
    exactly once; the instruction prints, parses and round-trips through JSON."""
    torch.manual_seed(0)
    model = MLP()
    mesh = _mesh_layout(model)
    graph = ClipGraph(model, _sgd(model.parameters()), accumulation=1)
    x, y = torch.randn(16, D), torch.randint(0, CLASSES, (16,))
    layout = (mesh, (sbp.split(0), sbp.broadcast))
    compiled = compile_graph(graph, [x, y], 4, [layout, layout])
    clips = {p.rank: next(i for i in p.instructions if isinstance(i, ClipGradNorm)) for p in compiled.plans}
    counted = {}
    for rank, clip in clips.items():
        for name in clip.params:
            counted.setdefault(name, []).append(rank)
        assert parse_instruction(str(clip)) == clip and parse_instruction(str(clip)).params == clip.params
        assert instruction_from_json(clip.to_json()).params == clip.params
        assert clip.to_json()["op"] == "all_reduce" and clip.ranks == (0, 1, 2, 3)
    split = {"model.fc1.weight", "model.fc1.bias", "model.fc2.weight"}
    assert set(counted) == {"model." + k for k, _ in model.named_parameters()}
    for name, ranks in counted.items():  # shards on ranks 0 and 1 (row 0 of the mesh)
        assert ranks == ([0, 1] if name in split else [0]), (name, ranks)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), True, "1"])
def test_bad_max_norm_is_a_user_error(bad):
    graph = ClipGraph.__new__(ClipGraph)
    graphc.Graph.__init__(graph)
    with pytest.raises(graphc.GraphcError, match="max_norm must be a finite number > 0"):
        graph.config.set_grad_clip_norm(bad)
