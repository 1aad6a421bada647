"""A small ResNet-style CNN: a convolutional stem, residual blocks (two 3x3 convolutions with
batch norm, and a strided 1x1 projection on the shortcut where the shape changes), global average
pooling and a linear classifier. Batch norm brings buffers (running statistics).

`factory()` is CPU sized; `factory_large()` is ResNet-50-like in width (meant for the meta device).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ResidualBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, widths: tuple[int, ...], blocks_per_stage: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        layers: list[nn.Module] = []
        c_in = widths[0]
        for i, c_out in enumerate(widths):
            for j in range(blocks_per_stage):
                layers.append(ResidualBlock(c_in, c_out, stride=2 if i > 0 and j == 0 else 1))
                c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers(self.stem(x))
        return self.fc(torch.flatten(self.pool(h), 1))


def build(widths: tuple[int, ...], blocks: int, classes: int, image: int, batch: int) -> tuple:
    model = ResNet(widths, blocks, classes)
    images = torch.randn(batch, 3, image, image)
    labels = torch.randint(0, classes, (batch,))
    return model, (images,), F.cross_entropy, (labels,)


def factory() -> tuple:
    return build((8, 16), blocks=2, classes=10, image=16, batch=8)


def factory_large() -> tuple:
    return build((256, 512, 1024, 2048), blocks=4, classes=1000, image=224, batch=32)
