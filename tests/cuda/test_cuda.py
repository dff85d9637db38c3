"""The CUDA path on one GPU (issue 37): `pytest -m cuda` (benchmarks/gpu.py runs it first).

Each test runs on `device`: the cuda variant is marked `cuda` and skips without a GPU; the
cpu variant runs the same code on the CPU, marked `slow`, so the test itself is known to
work before a GPU is lent (`pytest -m slow tests/cuda`). Oracles: float64 programs equal eager
PyTorch on the same device and the whole batch within 1e-10 (helpers.py); the AMP programs
equal eager autocast bit for bit (docs/design.md: Mixed precision; the same kernels on the
same shapes in the same order), on an MLP, whose kernels are deterministic on the GPU as on
the CPU (no embedding backward's atomics).
"""
import copy
import os
import sys

import pytest
import torch
import torch.nn as nn

import graphc
from helpers import ATOL, RTOL

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import gpt  # noqa: E402

DEVICES = [pytest.param("cpu", marks=pytest.mark.slow),
           pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs a CUDA device")])]


# -- the programs ---------------------------------------------------------------------------------
def tiny_gpt(device: str, dtype=torch.float64) -> gpt.GPT:
    torch.manual_seed(0)
    with torch.device(device):
        return gpt.GPT(gpt.GPTConfig(vocab_size=48, block_size=16, n_layer=2, n_head=2, n_embd=16)).to(dtype)


def token_batches(device: str, n: int = 3, rows: int = 4, block: int = 16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 48, (rows, block), generator=g).to(device),
             torch.randint(0, 48, (rows, block), generator=g).to(device)) for _ in range(n)]


class GPTGraph(graphc.Graph):
    """The GPT trained with AdamW: one stage, or two stages on the one device, optionally
    checkpointing its blocks."""

    def __init__(self, model, device: str, stages: int = 1, checkpoint: bool = False, accumulation: int = 2):
        super().__init__()
        self.model = model
        blocks = self.model.transformer.h
        if stages == 2:
            place = graphc.placement(device, ranks=[0])
            t = self.model.transformer
            for m in (t.wte, t.wpe, blocks[0]):
                m.config.set_stage(0, place)
            for m in (blocks[1], t.ln_f, self.model.lm_head):
                m.config.set_stage(1, place)
            self.config.set_pipeline_schedule("interleaved_1f1b")
        if checkpoint:
            for i in range(len(model.transformer.h)):
                blocks[i].config.set_activation_checkpointing(True)
        self.config.set_gradient_accumulation_steps(accumulation)
        self.add_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))

    def build(self, idx, targets):
        loss = gpt.lm_loss(self.model(idx), targets)
        loss.backward()
        return loss


def eager_gpt(model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = gpt.lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def assert_same_training(graph, model, ref, batches, device: str) -> None:
    """graphc's steps against eager's on the same device, float64, 1e-10."""
    want = eager_gpt(ref, batches)
    got = [graph(x, y).to_local() for x, y in batches]
    assert all(loss.device.type == device for loss in got)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=ATOL, rtol=RTOL)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.device.type == device, name
        torch.testing.assert_close(p.detach(), q.detach(), atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))

    def forward(self, x):
        return self.net(x)


class AmpGraph(graphc.Graph):
    def __init__(self, model, dtype, scaler: bool):
        super().__init__()
        self.model = model
        self.config.enable_amp(True, dtype=dtype)
        if scaler:
            self.set_grad_scaler(graphc.amp.GradScaler(init_scale=2.0 ** 16))
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, x, y):
        loss = ((self.model(x).float() - y) ** 2).mean()
        loss.backward()
        return loss


def float_batches(device: str, n: int = 4):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(32, 16, generator=g, dtype=torch.float32).to(device),
             torch.randn(32, 8, generator=g, dtype=torch.float32).to(device)) for _ in range(n)]


# -- the tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_one_stage_float64_equals_eager_on_the_device(device):
    model = tiny_gpt(device)
    ref = copy.deepcopy(model)
    assert_same_training(GPTGraph(model, device), model, ref, token_batches(device), device)


@pytest.mark.parametrize("device", DEVICES)
def test_two_stages_on_one_device(device):
    model = tiny_gpt(device)
    ref = copy.deepcopy(model)
    graph = GPTGraph(model, device, stages=2)
    assert_same_training(graph, model, ref, token_batches(device), device)
    assert graph.plan.local_stages == [0, 1]


@pytest.mark.parametrize("device", DEVICES)
def test_activation_checkpointing(device):
    model = tiny_gpt(device)
    ref = copy.deepcopy(model)
    graph = GPTGraph(model, device, checkpoint=True)
    assert_same_training(graph, model, ref, token_batches(device), device)
    assert graph.last_stats.max_live_activations[0] >= 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_amp_equals_eager_autocast(device, dtype):
    """bf16, and fp16 with loss scaling (graphc's GradScaler against torch's), bit for bit."""
    torch.manual_seed(0)
    model = MLP().float().to(device)
    ref = copy.deepcopy(model)
    scaled = dtype == torch.float16
    graph = AmpGraph(model, dtype, scaler=scaled)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 16, enabled=scaled)
    for x, y in float_batches(device):
        got = graph(x, y).to_local()
        opt.zero_grad()
        with torch.autocast(device, dtype=dtype):
            out = ref(x)
        loss = ((out.float() - y) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        assert torch.equal(got, loss.detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    if scaled:
        assert graph.grad_scaler.get_scale() == scaler.get_scale()


@pytest.mark.parametrize("device", DEVICES)
def test_zero_on_one_rank(device):
    """ZeRO stage 2 on a world of one: one shard holds every row; the numbers are eager's."""
    model = tiny_gpt(device)
    ref = copy.deepcopy(model)
    graph = GPTGraph(model, device)
    graph.config.enable_zero(True, stage=2, shard_min_size=1)
    assert_same_training(graph, model, ref, token_batches(device), device)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("stages, checkpoint", [(1, False), (2, False), (1, True)],
                         ids=["one_stage", "two_stages", "checkpointed"])
def test_cuda_graphs_bitwise_equal_to_uncaptured_over_10_steps(stages, checkpoint):
    """config.set_cuda_graphs: call 1 warms up, call 2 captures, calls 3-10 replay; every
    loss and every parameter after 10 steps equal to the uncaptured graph's bit for bit
    (float32: the captured kernels are the uncaptured ones). On the CPU the option is refused
    (tests/runtime/test_cuda_graphs.py)."""
    plain_model = tiny_gpt("cuda", torch.float32)
    captured_model = copy.deepcopy(plain_model)
    plain = GPTGraph(plain_model, "cuda", stages=stages, checkpoint=checkpoint)
    captured = GPTGraph(captured_model, "cuda", stages=stages, checkpoint=checkpoint)
    captured.config.set_cuda_graphs(True)
    for x, y in token_batches("cuda", n=10):
        want, got = plain(x, y).to_local(), captured(x, y).to_local()
        assert torch.equal(got, want)
    for (name, p), q in zip(captured_model.named_parameters(), plain_model.parameters()):
        assert torch.equal(p, q), name
    step_graph = captured._runtime.step_graph
    assert step_graph.calls == 10 and step_graph.captures == 1
