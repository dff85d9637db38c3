"""A small ResNet-style conv net for the data-parallel batch-norm tests.

Conv2d, BatchNorm2d, ReLU, max pooling, a residual basic block (with a strided 1x1
projection), average pooling, adaptive average pooling, Flatten, Linear; plus a Conv1d /
BatchNorm1d / GroupNorm / AvgPool1d branch, so every layer the SBP rules cover is used.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout, momentum=None)  # cumulative running statistics
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.down is None else self.down(x)
        return self.relu(out + identity)


class ConvNet(nn.Module):
    """x [N, 3, 8, 8] -> logits [N, classes]."""

    def __init__(self, classes: int = 5, width: int = 4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.MaxPool2d(2, stride=1, padding=1))
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.pool = nn.AvgPool2d(2)
        self.seq = nn.Sequential(nn.Conv1d(2 * width, width, 3, padding=1), nn.BatchNorm1d(width),
                                 nn.GroupNorm(2, width), nn.ReLU(), nn.AvgPool1d(2))
        self.gap = nn.AdaptiveAvgPool2d((1, 1))
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(2 * width + width * 2, classes)

    def forward(self, x):
        h = self.pool(self.layer2(self.layer1(self.stem(x))))          # [N, 2w, 2, 2]
        seq = self.seq(h.flatten(2))                                     # [N, w, 2]
        return self.fc(torch.cat([self.flatten(self.gap(h)), torch.flatten(seq, 1)], dim=1))
