"""Model specs the runtime benchmarks compile and run: the example MLP and a GPT-style decoder.

`bench/bench_models.py:mlp_bench` and `:gpt_bench` are model specs for `dapple compile`; the
torch.distributed.pipelining side of the comparison builds the very same `nn.Sequential` (same seed,
same layers) with `build_model`, and cuts it where our plan cut.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: (width, depth) of each size; d_in = d_out = width so that every hidden layer costs the same.
SIZES: dict[str, tuple[int, int]] = {"tiny": (32, 4), "bench": (512, 8), "memory": (256, 8)}
#: GPT sizes: (d_model, blocks, seq, heads, vocab, batch); "gpt" is d=256, 8 blocks, seq 64, batch 32.
GPT_SIZES: dict[str, tuple[int, int, int, int, int, int]] = {
    "gpt-tiny": (32, 4, 8, 4, 64, 8),
    "gpt": (256, 8, 64, 4, 512, 32),
}


def _example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_dapple_examples_{name}", ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: the dataclasses of examples/gpt.py look their module up by name.
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def build_mlp(size: str, batch: int = 8) -> tuple[Any, ...]:
    """`examples/mlp.py`'s `build` at one of `SIZES`: (model, inputs, loss_fn, targets)."""
    width, depth = SIZES[size]
    return _example("mlp").build(width=width, depth=depth, d_in=width, d_out=width, batch=batch)  # type: ignore[no-any-return]


def build_gpt(size: str) -> tuple[Any, ...]:
    """A GPT-style decoder as an `nn.Sequential` (embeddings, pre-norm blocks, norm + untied LM head) of plain
    torch modules, so that both runtimes cut it between children: (model, inputs, loss_fn, targets)."""
    import torch
    from torch import nn

    gpt = _example("gpt")
    d, blocks, seq, heads, vocab, batch = GPT_SIZES[size]
    cfg = gpt.GPTConfig(vocab=vocab, seq=seq, d_model=d, n_layer=blocks, n_head=heads, batch=batch)

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(seq, d)
            nn.init.normal_(self.tok.weight, std=0.02)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_f = nn.LayerNorm(d)
            self.lm = nn.Linear(d, vocab, bias=False)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.lm(self.ln_f(h))

    model = nn.Sequential(Embed(), *[gpt.Block(cfg) for _ in range(blocks)], Head())
    idx = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))
    return model, (idx,), gpt.gpt_loss, (targets,)


def build_model(size: str) -> tuple[Any, ...]:
    """Any size of `SIZES` or `GPT_SIZES` by name."""
    return build_gpt(size) if size in GPT_SIZES else build_mlp(size)


def mlp_tiny() -> tuple[Any, ...]:
    return build_mlp("tiny")


def mlp_bench() -> tuple[Any, ...]:
    return build_mlp("bench")


def mlp_memory() -> tuple[Any, ...]:
    return build_mlp("memory")


def gpt_tiny() -> tuple[Any, ...]:
    return build_gpt("gpt-tiny")


def gpt_bench() -> tuple[Any, ...]:
    return build_gpt("gpt")
