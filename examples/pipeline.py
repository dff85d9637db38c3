"""Two-stage pipeline training of an MNIST-shaped MLP (OneFlow's pipeline guide, in graphc).

    torchrun --nproc_per_node 2 examples/pipeline.py            # cpu, gloo
    torchrun --nproc_per_node 2 examples/pipeline.py --device cuda

Stage 0 (flatten, linear, relu) runs on rank 0, stage 1 (two linear layers) on rank 1;
each step splits the batch into micro-batches scheduled 1F1B.
"""
import argparse

import torch
import torch.nn as nn

import graphc


class Stage0Module(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear0 = nn.Linear(28 * 28, 512)
        self.relu0 = nn.ReLU()

    def forward(self, x):
        return self.relu0(self.linear0(self.flatten(x)))


class Stage1Module(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(512, 512)
        self.relu1 = nn.ReLU()
        self.linear2 = nn.Linear(512, 10)
        self.relu2 = nn.ReLU()

    def forward(self, x):
        return self.relu2(self.linear2(self.relu1(self.linear1(x))))


class PipelineModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.m_stage0 = Stage0Module()
        self.m_stage1 = Stage1Module()

    def forward(self, x):
        return self.m_stage1(self.m_stage0(x))


class PipelineGraph(graphc.Graph):
    def __init__(self, model, optimizer, p0, p1, accumulation, schedule):
        super().__init__()
        self.module_pipeline = model
        self.module_pipeline.m_stage0.config.set_stage(stage_id=0, placement=p0)
        self.module_pipeline.m_stage1.config.set_stage(stage_id=1, placement=p1)
        self.loss_fn = nn.CrossEntropyLoss()
        self.config.set_gradient_accumulation_steps(accumulation)
        self.config.set_pipeline_schedule(schedule)
        self.add_optimizer(optimizer)

    def build(self, x, y):
        out = self.module_pipeline(x)
        loss = self.loss_fn(out, y)
        loss.backward()
        return loss


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()

    torch.manual_seed(0)
    p0 = graphc.placement(args.device, ranks=[0])
    p1 = graphc.placement(args.device, ranks=[1])
    model = PipelineModule()
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    graph = PipelineGraph(model, sgd, p0, p1, args.accumulation, args.schedule)

    # a fixed random batch: the loss must fall as the model fits it
    x = torch.randn(args.batch_size, 1, 28, 28)
    y = torch.randint(0, 10, (args.batch_size,))
    x = graphc.to_global(x, placement=p0, sbp=graphc.sbp.broadcast)
    y = graphc.to_global(y, placement=p1, sbp=graphc.sbp.broadcast)
    for step in range(args.steps):
        loss = graph(x, y).to_local()
        if loss.numel():  # the loss lives on stage 1's rank
            print(f"step {step:3d}  loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
