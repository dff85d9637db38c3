"""A ResNet-18-shaped conv net with BatchNorm on random images, pipeline x data parallel.

    python examples/resnet.py                                  # one process
    torchrun --nproc_per_node 2 examples/resnet.py --pp 2      # pipeline of 2
    torchrun --nproc_per_node 2 examples/resnet.py --dp 2      # data parallel (sync BatchNorm)
    torchrun --nproc_per_node 4 examples/resnet.py --pp 2 --dp 2

Four stages of two basic blocks (conv-BN-ReLU-conv-BN plus a shortcut), adaptive average
pooling and a linear classifier, as torchvision writes ResNet-18 (narrower, for CPUs).
BatchNorm semantics (docs/design.md): under data parallel the split batch is normalised
with the statistics of the whole batch (SBP makes sync-BN the natural meaning: eager's
numbers); with gradient accumulation each micro-batch is normalised with its own
statistics, as in eager accumulation, and --deferred-bn makes the running statistics
those of the whole mini-batch, updated once per step.
"""
import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, widths=(8, 16, 32, 64), classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU())
        layers, cin = [], widths[0]
        for i, w in enumerate(widths):
            stride = 1 if i == 0 else 2
            layers.append(nn.Sequential(BasicBlock(cin, w, stride), BasicBlock(w, w, 1)))
            cin = w
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[-1], classes)

    def forward(self, x):
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


def stage_ranks(stage: int, dp: int):
    return list(range(stage * dp, (stage + 1) * dp))


class ResNetGraph(graphc.Graph):
    def __init__(self, model, opt, pp: int = 1, dp: int = 1, accumulation: int = 1,
                 deferred_bn: bool = False):
        super().__init__()
        self.model = model
        if pp > 1:
            first = graphc.placement("cpu", ranks=stage_ranks(0, dp))
            last = graphc.placement("cpu", ranks=stage_ranks(1, dp))
            for name in ("stem", "layer1", "layer2"):
                getattr(self.model, name).config.set_stage(0, first)
            for name in ("layer3", "layer4", "pool", "fc"):
                getattr(self.model, name).config.set_stage(1, last)
        self.config.set_gradient_accumulation_steps(accumulation)
        if deferred_bn:
            self.config.set_deferred_batch_norm(True)
        self.add_optimizer(opt)

    def build(self, images, labels):
        loss = F.cross_entropy(self.model(images), labels)
        loss.backward()
        return loss


def global_inputs(rank: int, pp: int, dp: int, images, labels):
    """This rank's rows of the batch (data parallel), as global tensors; whole without --dp."""
    if dp == 1:
        return images, labels
    row = rank % dp
    first = graphc.placement("cpu", ranks=stage_ranks(0, dp))
    last = graphc.placement("cpu", ranks=stage_ranks(pp - 1, dp))
    return (graphc.to_global(images.chunk(dp)[row], placement=first, sbp=graphc.sbp.split(0)),
            graphc.to_global(labels.chunk(dp)[row], placement=last, sbp=graphc.sbp.split(0)))


def data(steps: int, batch: int, size: int = 16, classes: int = 10, seed: int = 0):
    """Random images whose class shifts their mean, so the loss can fall."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        labels = torch.randint(0, classes, (batch,), generator=g)
        images = torch.randn(batch, 3, size, size, generator=g) + labels.view(-1, 1, 1, 1) / classes
        yield images, labels


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=1, choices=[1, 2])
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--deferred-bn", action="store_true")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world != args.pp * args.dp:
        raise SystemExit(f"--pp {args.pp} --dp {args.dp} needs {args.pp * args.dp} processes")
    torch.manual_seed(0)
    model = ResNet()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    graph = ResNetGraph(model, opt, args.pp, args.dp, args.accumulation, args.deferred_bn)
    for step, (x, y) in enumerate(data(args.steps, args.batch)):
        start = time.perf_counter()
        loss = graph(*global_inputs(rank, args.pp, args.dp, x, y)).to_local()
        took = time.perf_counter() - start
        if loss.numel() and rank == world - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}  {len(x) / took:7.1f} images/s", flush=True)


if __name__ == "__main__":
    main()
