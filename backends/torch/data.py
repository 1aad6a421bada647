"""Training data for a run: the global batch of each step, and its microbatches.

Convention (the same for the pipelined run and the single-device reference):

- By default the data is synthetic and seeded: for step `k`, every example input and example
  target of the model spec becomes a tensor of `global_batch` rows with the example's trailing
  shape and dtype, drawn from a generator seeded with `(seed, k)`. Floating tensors are standard
  normal; integer and bool tensors are uniform over the example's own value range (so token ids
  stay below the vocabulary size and class labels stay valid). Non-tensor inputs pass unchanged.
- A model file may instead define, next to its factory, `dapple_data(step, global_batch, seed)`
  returning `(inputs, targets)` (two tuples, every tensor with `global_batch` rows). Being indexed
  by step, it resumes from a checkpoint without replaying earlier steps.

Microbatch `m` of size `b` is rows `m*b .. (m+1)*b` of every tensor.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from dapple_ir.errors import DappleError
from dapple_ir.frontend.model_spec import _resolve_factory

DataFn = Callable[[int, int, int], tuple[tuple[Any, ...], tuple[Any, ...]]]


def synthetic_batch(
    example_inputs: tuple[Any, ...], example_targets: tuple[Any, ...], global_batch: int, seed: int, step: int
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The seeded synthetic global batch of `step` (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    inputs = tuple(_like(x, global_batch, gen) for x in example_inputs)
    targets = tuple(_like(t, global_batch, gen) for t in example_targets)
    return inputs, targets


def _like(example: Any, rows: int, gen: torch.Generator) -> Any:
    if not isinstance(example, torch.Tensor) or example.dim() == 0:
        return example
    shape = (rows, *example.shape[1:])
    ex = example.detach().cpu()
    if ex.is_floating_point():
        return torch.randn(shape, generator=gen, dtype=ex.dtype)
    if ex.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    low = int(ex.min()) if ex.numel() else 0
    high = int(ex.max()) + 1 if ex.numel() else 1
    return torch.randint(low, max(high, low + 1), shape, generator=gen, dtype=ex.dtype)


def data_function(spec: str) -> DataFn | None:
    """`dapple_data` defined next to the factory of `spec`, if any."""
    factory = _resolve_factory(spec)
    module = sys.modules.get(getattr(factory, "__module__", ""))
    fn = getattr(module, "dapple_data", None) if module is not None else None
    return fn if callable(fn) else None


def microbatch(values: tuple[Any, ...], mb: int, size: int) -> tuple[Any, ...]:
    """Rows `mb*size .. (mb+1)*size` of every tensor in `values` (others unchanged)."""
    return tuple(v[mb * size : (mb + 1) * size] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for v in values)


def check_batch(inputs: tuple[Any, ...], targets: tuple[Any, ...], global_batch: int, where: str) -> None:
    """Every tensor of a provided batch must have `global_batch` rows."""
    for i, v in enumerate((*inputs, *targets)):
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] != global_batch:
            raise DappleError(
                f"{where} returned a tensor (item {i}) with {v.shape[0]} rows; "
                f"the plan's global batch is {global_batch}"
            )
