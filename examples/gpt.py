"""A GPT-style decoder: token and position embeddings, N pre-norm blocks of causal self-attention
and an MLP, a final layer norm and an LM head tied to the token embedding; cross-entropy loss.

`factory()` is small enough to train on a CPU in tests; `factory_large()` is GPT-2 XL sized
(1.56B parameters) and meant for the meta device: `dapple dump examples/gpt.py:factory_large`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 96
    seq: int = 16
    d_model: int = 32
    n_layer: int = 4
    n_head: int = 4
    batch: int = 4

    @property
    def param_count(self) -> int:
        """Trainable parameters in closed form (the LM head is tied to the token embedding)."""
        d = self.d_model
        per_block = 12 * d * d + 13 * d  # ln1, qkv, proj, ln2, fc (4d), fc_out
        return self.vocab * d + self.seq * d + self.n_layer * per_block + 2 * d


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (b, t, d) -> (b, heads, t, d / heads)
        q = q.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # GPT-2's small embedding init keeps the tied head's first logits (and loss) moderate.
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        h = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            h = block(h)
        # The LM head reuses the token embedding: one parameter read in two places.
        return F.linear(self.ln_f(h), self.tok.weight)


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build(cfg: GPTConfig) -> tuple[nn.Module, tuple[torch.Tensor], object, tuple[torch.Tensor]]:
    idx = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
    targets = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
    return GPT(cfg), (idx,), gpt_loss, (targets,)


def factory() -> tuple[nn.Module, tuple[torch.Tensor], object, tuple[torch.Tensor]]:
    return build(GPTConfig())


#: GPT-2 XL: 48 layers, d_model 1600, 25 heads, 1024 tokens, vocabulary 50257 (1.56B parameters).
LARGE = GPTConfig(vocab=50257, seq=1024, d_model=1600, n_layer=48, n_head=25, batch=8)


def factory_large() -> tuple[nn.Module, tuple[torch.Tensor], object, tuple[torch.Tensor]]:
    return build(LARGE)
