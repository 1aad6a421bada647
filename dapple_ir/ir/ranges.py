"""Range checks on the numbers a module carries: tensor dimensions, counts, byte sizes and times.

The parser accepts any 64-bit integer and any finite number, because the grammar cannot know
what a number means; these checks do. Every count (batch sizes, microbatches, replicas) is at
least 1, every dimension, index, size, time and device id is finite and non-negative, and the
batch arithmetic agrees: microbatches × microbatch_size = global_batch, and each input's leading
dimension is the captured batch. The verifier reports the first problem with its location.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from dapple_ir.ir.core import HALF_PRECISIONS, AttrRecord, Module, Op, OpKind, TensorType, TupleType, Type

#: Attributes that count something and so must be at least 1.
_COUNTS = frozenset({"batch", "cost_batch", "global_batch", "microbatches", "microbatch_size", "replicas"})


def type_problem(t: Type) -> str | None:
    """What is wrong with a type's dimensions, if anything."""
    if isinstance(t, TensorType):
        bad = [d for d in t.shape if d < 0]
        return f"type {t.dtype}{list(t.shape)} has a negative dimension {bad[0]}" if bad else None
    if isinstance(t, TupleType):
        return next((p for p in map(type_problem, t.elements) if p), None)
    return None


def attr_problems(record: AttrRecord) -> Iterator[str]:
    """Each attribute of `record` whose value is out of range."""
    for name, value in record.items():
        if name == "precision" and value not in HALF_PRECISIONS:
            known = ", ".join(map(repr, HALF_PRECISIONS))
            yield f"attribute precision = {value!r} must be one of {known} (fp32 is its absence)"
        if name == "zero" and value != 1:
            yield f"attribute zero = {value!r} must be 1 (ZeRO-1: sharded optimizer state; unsharded is its absence)"
        numbers = value if isinstance(value, tuple) else (value,)
        for number in numbers:
            if isinstance(number, bool) or not isinstance(number, int | float):
                continue
            if not math.isfinite(number):
                yield f"attribute {name} = {number} is not a finite number"
            elif name in _COUNTS and number < 1:
                yield f"attribute {name} = {number} must be at least 1"
            elif number < 0:
                yield f"attribute {name} = {number} must not be negative"


def batch_problem(module: Module) -> str | None:
    """Where the module's batch attributes disagree with each other or with its input types."""
    a = module.attrs
    if a.microbatches and a.microbatch_size and a.global_batch and a.microbatches * a.microbatch_size != a.global_batch:
        return (
            f"module says microbatches = {a.microbatches} and microbatch_size = {a.microbatch_size}, "
            f"whose product is not its global_batch = {a.global_batch}"
        )
    if not a.batch:
        return None
    for op in module.ops:
        leading = (
            op.type.shape[0] if op.kind is OpKind.INPUT and isinstance(op.type, TensorType) and op.type.shape else None
        )
        if leading is not None and leading != a.batch:
            return (
                f"input %{op.name} has batch dimension {leading} but the module's types are captured at "
                f"batch = {a.batch}"
            )
    return None


def stage_cycle(module: Module) -> list[str] | None:
    """Stage names along a cycle of the stage graph (a value flowing from a stage back to an earlier
    one through another), or None when the stages form a DAG."""
    stage_of: dict[Op, str] = {op: stage.name for stage in module.stages for op in stage.ops}
    edges: dict[str, set[str]] = {stage.name: set() for stage in module.stages}
    for op in module.ops:
        for operand in op.operands:
            src, dst = stage_of.get(operand), stage_of.get(op)
            if src is not None and dst is not None and src != dst:
                edges[src].add(dst)
    # Iterative depth-first search (a recursive one would overflow on thousands of stages).
    state: dict[str, int] = {}
    for root in edges:
        if root in state:
            continue
        path, stack = [root], [iter(sorted(edges[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(edges[nxt])))
    return None
