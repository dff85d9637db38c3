"""A model already on its device (a GPU; here the meta device, which no CPU op accepts
either) is traced on CPU fakes of its parameters and buffers, like its inputs (cpu_fake in
passes/build_tracer.py, NOTE: CUDA placement): before, the first op mixing an input with a
weight failed ("found at least two devices, meta and cpu")."""
import os
import sys

import pytest
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


@pytest.mark.fp32   # autocast casts float32, not the suite's float64
def test_cuda_amp_plan_lists_the_dtypes_the_gpu_sends():
    """enable_amp on cuda stages: the trace on CPU stand-ins runs under a cpu region beside the
    cuda one, so a Linear's output crossing to the next stage is listed bf16, as the GPU sends
    it (a cuda region alone cast nothing on the CPU: f32 was listed, a receive buffer twice the
    size of the send)."""
    plans = {}
    for device in ("cpu", "cuda"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))

        class Pipeline(graphc.Graph):
            def __init__(self):
                super().__init__()
                self.model = model
                self.model[0].config.set_stage(0, graphc.placement(device, ranks=[0]))
                self.model[1].config.set_stage(1, graphc.placement(device, ranks=[1]))
                self.config.enable_amp(True, dtype=torch.bfloat16)
                self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

            def build(self, x):
                loss = self.model(x).float().pow(2).mean()
                loss.backward()
                return loss
        plans[device] = compile_graph(Pipeline(), [torch.randn(4, 8)], 2).plans[0]
    sends = {d: [str(i) for i in p.instructions if "SEND" in str(i)] for d, p in plans.items()}
    assert sends["cuda"] == sends["cpu"] and "bf16[4,8]" in sends["cuda"][0], sends
