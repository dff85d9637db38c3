"""Small models shared by the tests."""
import torch
import torch.nn as nn

import graphc


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.linear = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.norm(self.linear(x)))


class SkipNet(nn.Module):
    """p blocks in a row plus a head; the first block's output skips straight into the head."""

    def __init__(self, p: int, d: int = 16, classes: int = 5):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(p)])
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        first = self.blocks[0](x)
        h = first
        for block in self.blocks[1:]:
            h = block(h)
        return self.head(h + first)


class PipelineGraph(graphc.Graph):
    """SkipNet with block s on stage s (rank s); the head joins the last stage."""

    def __init__(self, model: SkipNet, opt, sched=None, accumulation: int = 1, schedule: str = "1f1b",
                 device: str = "cpu"):
        super().__init__()
        self.model = model
        p = len(model.blocks)
        for s in range(p):
            self.model.blocks[s].config.set_stage(s, graphc.placement(device, ranks=[s]))
        self.model.head.config.set_stage(p - 1, graphc.placement(device, ranks=[p - 1]))
        self.loss_fn = nn.CrossEntropyLoss()
        self.config.set_gradient_accumulation_steps(accumulation)
        self.config.set_pipeline_schedule(schedule)
        if opt is not None:
            self.add_optimizer(opt, sched)

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def make_batches(n: int = 3, batch: int = 16, d: int = 16, classes: int = 5, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(n)]


OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def make_sched(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
