"""Models whose code picks its ops by the device its tensors are on, as transformers' mixture-of-experts
layer does (`test_trace_device.py`): each counts how many samples fall in each of 4 bins with `histc`,
which the CPU runs on floats only, and scales its output by the counts. Both train on 2 CPU ranks with
the loss `F.mse_loss`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BINS = 4


class BinCounts(nn.Module):
    """Scales a Linear's output by the share of the batch in each sample's bin (argmax over 4 outputs).

    `picks_by_device`: like transformers, counting on float ids on the CPU and on int ids elsewhere (the
    CPU's histc has no integer kernel, a GPU's wants integers); otherwise always on int ids, which no CPU
    can run."""

    def __init__(self, picks_by_device: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(8, BINS)
        self.picks_by_device = picks_by_device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        ids = y.argmax(-1)
        on_cpu = x.device.type == "cpu"
        counted = ids.float() if self.picks_by_device and on_cpu else ids.int()
        counts = torch.histc(counted, bins=BINS, min=0, max=BINS - 1)
        return y * (1 + counts.float()[ids].unsqueeze(-1) / x.shape[0])


def _example(model: nn.Module) -> tuple:
    return model, (torch.randn(8, 8),), F.mse_loss, (torch.randn(8, BINS),)


def picks_by_device() -> tuple:
    return _example(BinCounts(picks_by_device=True))


def always_int() -> tuple:
    return _example(BinCounts(picks_by_device=False))
