"""FLOPs of grouped matrix multiplies, which torch's FLOP counter does not know.

A mixture-of-experts layer sorts its (token, expert) pairs by expert and multiplies each group of
rows by its own expert's matrix in one grouped multiply: `torch._grouped_mm` (what
`torch.nn.functional.grouped_mm` calls), or transformers' `grouped_mm_fallback` custom op where that
is unavailable or being traced. Left to torch's counter they cost nothing, and the experts' compute
would be free to the planner.

Each row of the left operand meets exactly one group's matrix, whatever the routing: a grouped
multiply of `a` by `b` costs `2 * a.numel() * b.shape[-1]` FLOPs in every layout torch allows
(2-D by 3-D as in the forward, 2-D by 2-D into 3-D as in the weight gradient, 3-D by 3-D as a
batched multiply). The rows are the routed pairs (tokens x top-k), so the experts are priced at the
routed fraction top_k / num_experts of running every token through every expert.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["grouped_matmul_formulas"]

Shape = tuple[int, ...]


def _grouped(a: Shape, b: Shape, *_args: Any, out_shape: Any = None, **_kwargs: Any) -> int:
    """`a` grouped-multiplied by `b` (the forward, and each of torch's two backward multiplies)."""
    return 2 * math.prod(a) * b[-1]


def _grouped_backward(a: Shape, b: Shape, *_args: Any, out_shape: Any = None, **_kwargs: Any) -> int:
    """transformers' backward op: the input gradient and the weight gradient, each as large as the forward."""
    return 2 * _grouped(a, b)


#: (namespace, op name, formula) of the grouped multiplies priced here; an op not registered in this
#: process (transformers' when transformers is not imported) is left out.
_KNOWN: tuple[tuple[str, str, Callable[..., int]], ...] = (
    ("aten", "_grouped_mm", _grouped),
    ("transformers", "grouped_mm_fallback", _grouped),
    ("transformers", "grouped_mm_fallback_backward", _grouped_backward),
)


def grouped_matmul_formulas() -> dict[Any, Callable[..., int]]:
    """`FlopCounterMode(custom_mapping=...)` entries for the grouped multiplies registered in this process."""
    found: dict[Any, Callable[..., int]] = {}
    for namespace, name, formula in _KNOWN:
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None:
            found[packet] = formula
    return found
