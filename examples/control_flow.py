"""A model with Python control flow on tensor shapes, which `torch.fx` symbolic tracing cannot
follow (it iterates over `split` and branches on `x.shape`) but `torch.export` can, since shapes
are known while it traces. `dapple dump examples/control_flow.py:factory` says it used export.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ChunkedMixer(nn.Module):
    def __init__(self, d_in: int, d_model: int, chunk: int, classes: int) -> None:
        super().__init__()
        self.chunk = chunk
        self.d_model = d_model
        self.proj_in = nn.Linear(d_in, d_model)
        self.mix = nn.Linear(d_model, d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Inputs narrower than the model are projected; fx cannot decide this branch.
        if x.shape[-1] != self.d_model:
            x = self.proj_in(x)
        # The sequence is processed chunk by chunk, each chunk seeing a running summary of the earlier ones.
        summary = torch.zeros_like(x[:, 0])
        outs = []
        for part in x.split(self.chunk, dim=1):
            part = torch.tanh(self.mix(part + summary.unsqueeze(1)))
            summary = summary + part.mean(dim=1)
            outs.append(part)
        return self.head(torch.cat(outs, dim=1).mean(dim=1))


def build(d_in: int, d_model: int, chunk: int, seq: int, classes: int, batch: int) -> tuple:
    model = ChunkedMixer(d_in, d_model, chunk, classes)
    return model, (torch.randn(batch, seq, d_in),), F.cross_entropy, (torch.randint(0, classes, (batch,)),)


def factory() -> tuple:
    return build(d_in=12, d_model=16, chunk=4, seq=12, classes=3, batch=4)


def factory_large() -> tuple:
    return build(d_in=1024, d_model=8192, chunk=256, seq=2048, classes=1000, batch=16)
