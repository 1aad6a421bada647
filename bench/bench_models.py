"""Model specs the runtime benchmarks compile and run: the example MLP at benchmark sizes.

`bench/bench_models.py:mlp_bench` is a model spec for `dapple compile`; the torch.distributed.pipelining
side of the comparison builds the very same `nn.Sequential` (same seed, same layers) with `build_mlp`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: (width, depth) of each size; d_in = d_out = width so that every hidden layer costs the same.
SIZES: dict[str, tuple[int, int]] = {"tiny": (32, 4), "bench": (512, 8), "memory": (256, 8)}


def _examples_mlp() -> Any:
    spec = importlib.util.spec_from_file_location("_dapple_examples_mlp", ROOT / "examples" / "mlp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_mlp(size: str, batch: int = 8) -> tuple[Any, ...]:
    """`examples/mlp.py`'s `build` at one of `SIZES`: (model, inputs, loss_fn, targets)."""
    width, depth = SIZES[size]
    return _examples_mlp().build(width=width, depth=depth, d_in=width, d_out=width, batch=batch)  # type: ignore[no-any-return]


def mlp_tiny() -> tuple[Any, ...]:
    return build_mlp("tiny")


def mlp_bench() -> tuple[Any, ...]:
    return build_mlp("bench")


def mlp_memory() -> tuple[Any, ...]:
    return build_mlp("memory")
