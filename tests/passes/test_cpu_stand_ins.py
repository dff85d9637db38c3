"""A model already on its device (a GPU; here the meta device, which no CPU op accepts
either) is traced on CPU fakes of its parameters and buffers, like its inputs (cpu_fake in
passes/build_tracer.py, NOTE: CUDA placement): before, the first op mixing an input with a
weight failed ("found at least two devices, meta and cpu")."""
import os
import sys

import torch

import graphc
from helpers import compile_graph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import gpt  # noqa: E402


class LM(graphc.Graph):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(2)
        self.add_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

    def build(self, idx, targets):
        loss = gpt.lm_loss(self.model(idx), targets)
        loss.backward()
        return loss


def _gpt(device: str) -> gpt.GPT:
    torch.manual_seed(0)
    with torch.device(device):
        return gpt.GPT(gpt.GPTConfig(vocab_size=48, block_size=16, n_layer=2, n_head=2, n_embd=16))


def test_a_model_off_the_cpu_compiles_the_cpu_model_plan():
    batch = [torch.randint(0, 48, (4, 16)), torch.randint(0, 48, (4, 16))]
    on_meta = compile_graph(LM(_gpt("meta")), batch, 1)
    on_cpu = compile_graph(LM(_gpt("cpu")), batch, 1)
    assert str(on_meta.plans[0]) == str(on_cpu.plans[0])
    assert on_meta.programs[0].module.code == on_cpu.programs[0].module.code
    assert on_meta.stages[0].device_type == "cpu"   # the parameters' device type: neither cuda


def test_tied_weights_keep_one_fake():
    """GPT ties wte and lm_head: one parameter, traced as one fake, held once by the program."""
    model = _gpt("meta")
    compiled = compile_graph(LM(model), [torch.randint(0, 48, (4, 16))] * 2, 1)
    held = list(compiled.programs[0].module.parameters())
    assert len(held) == len(list(model.parameters()))
    assert any(p is model.lm_head.weight for p in held)
