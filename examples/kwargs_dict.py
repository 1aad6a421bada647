"""A Hugging Face-style classifier: called with keyword arguments (`input_ids`, `attention_mask`,
`labels`) and returning a dict whose `"loss"` entry is the training loss, so the factory gives no
loss function. The example inputs are a dict: the keyword arguments.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MaskedMeanClassifier(nn.Module):
    def __init__(self, vocab: int, d_model: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.encoder = nn.Sequential(nn.Linear(d_model, d_model), nn.Tanh(), nn.LayerNorm(d_model))
        self.head = nn.Linear(d_model, classes)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        h = self.encoder(self.embed(input_ids))
        # Mean over the unmasked tokens only.
        mask = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        logits = self.head(pooled)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def build(vocab: int, d_model: int, classes: int, seq: int, batch: int) -> tuple:
    model = MaskedMeanClassifier(vocab, d_model, classes)
    lengths = torch.randint(1, seq + 1, (batch, 1))
    inputs = {
        "input_ids": torch.randint(0, vocab, (batch, seq)),
        "attention_mask": (torch.arange(seq).unsqueeze(0) < lengths).long(),
        "labels": torch.randint(0, classes, (batch,)),
    }
    return model, inputs


def factory() -> tuple:
    return build(vocab=100, d_model=32, classes=5, seq=12, batch=8)


def factory_large() -> tuple:
    return build(vocab=250_000, d_model=4096, classes=1000, seq=512, batch=16)
