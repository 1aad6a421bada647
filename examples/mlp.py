"""A plain MLP regressor (nn.Sequential of Linear and ReLU) with a mean-squared-error loss.

`factory()` is CPU sized; `factory_large()` (16 layers of width 8192, about 1.1B parameters) is
meant for the meta device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def build(width: int = 64, depth: int = 4, d_in: int = 16, d_out: int = 8, batch: int = 8) -> tuple:
    layers: list[nn.Module] = [nn.Linear(d_in, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, d_out))
    model = nn.Sequential(*layers)
    return model, (torch.randn(batch, d_in),), F.mse_loss, (torch.randn(batch, d_out),)


def factory() -> tuple:
    return build()


def factory_large() -> tuple:
    return build(width=8192, depth=16, d_in=8192, d_out=8192, batch=32)
