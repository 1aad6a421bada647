"""What the `tensor-parallel` pass's marks mean for a set of ops run by a tensor group of T devices.

The planner asks which degrees a stage's ops allow (`tp_ok`, `degrees`) and where a cut would carry a split
value (`crosses_split`); the pricing layer asks which ops shard their work (`sharded_ops`: their FLOPs, bytes
and parameters divide by T) and which collectives the group runs: one forward allreduce of each row-parallel
result (`forward_reduces`), one backward allreduce of the gradient of each distinct whole input of
column-parallel ops (`backward_reduces`: q, k and v reading one value need one); the verifier checks stages
with `tp` > 1 through `tp_ok`. A split value's `tp_dim` is a dimension of its result (of each element, for a
tuple); `tp_parts` (default 1) equal parts of it are each cut into T contiguous pieces.

Imports the IR only (no torch).
"""

from __future__ import annotations

from collections.abc import Iterable

from dapple_ir.ir import Module, Op, OpKind, Param, TensorType
from dapple_ir.ir.verifier import is_tensor_split, tensor_split_problem

#: Degrees a tensor group may have by default: powers of two up to a node's eight devices.
DEFAULT_DEGREES: tuple[int, ...] = (1, 2, 4, 8)


def sharded_ops(ops: Iterable[Op]) -> list[Op]:
    """The ops whose FLOPs and activation bytes divide by T on a tensor group of T."""
    return [op for op in ops if op.tensor_split]


#: Roles whose ops sum over the tensor group in the forward: row-parallel matmuls, vocabulary-parallel embeddings
#: (each member's rows, zeros for indices outside its range) and cross-entropies over split classes.
FORWARD_SUM_ROLES = frozenset({"row", "vocab", "loss"})


def forward_reduces(ops: Iterable[Op]) -> list[Op]:
    """The ops of `ops` that sum over the group in the forward (`FORWARD_SUM_ROLES`; their bytes: `summed_bytes`)."""
    return [op for op in ops if op.attrs.tp_role in FORWARD_SUM_ROLES]


def summed_bytes(value: Op, t: int) -> float:
    """Bytes one sum over a tensor group of `t` moves for `value` (a `forward_reduces` op or a `backward_reduces`
    input) at the module's batch: the value's own bytes, but for a cross-entropy over split classes each member's
    log-sum-exp in its row of a [t + 1, N] fp32 table whose last row holds the target logits (N the targets)."""
    if value.attrs.tp_role != "loss":
        return value.out_bytes
    target = value.operands[1].type
    rows = target.numel if isinstance(target, TensorType) else 1
    return 4.0 * rows * (t + 1)


def backward_reduces(ops: Iterable[Op]) -> list[Op]:
    """The distinct whole inputs of the column-parallel ops of `ops`: the gradient of each (its bytes) is
    summed over the group in the backward, once however many column-parallel ops read it (a model input has
    no gradient to sum)."""
    seen: dict[Op, None] = {}
    for op in ops:
        if op.attrs.tp_role == "col" and op.operands and op.operands[0].kind is not OpKind.INPUT:
            seen.setdefault(op.operands[0], None)
    return list(seen)


def is_split(op: Op) -> bool:
    """Is `op`'s value held in pieces by a tensor group (not a parameter read: every stage loads its own)?"""
    return is_tensor_split(op)


def crosses_split(values: Iterable[Op]) -> Op | None:
    """The first of `values` (those crossing a stage boundary) that a tensor group holds in pieces: a cut
    there would fall inside a tensor-parallel pattern. None where no value is split."""
    return next((v for v in values if is_split(v)), None)


def split_params(module: Module, ops: Iterable[Op]) -> list[Param]:
    """The parameters `ops` read that a tensor group holds in pieces (`ParamAttrs.tp_dim`), once each."""
    table = {p.name: p for p in module.params}
    names: dict[str, None] = {}
    for op in ops:
        names.update(dict.fromkeys(op.read_params))
    return [table[n] for n in names if n in table and table[n].attrs.tp_dim is not None]


def tp_ok(module: Module, ops: list[Op], t: int, users: dict[Op, list[Op]] | None = None) -> str | None:
    """None if a stage holding `ops` can run on a tensor group of `t`, else a one-line reason naming the op
    or parameter: every split dimension (of results, parameters) divides into `tp_parts` * `t` pieces, and no
    split value enters or leaves the set (a pattern cut by a stage boundary). The verifier's own check of
    stages with `tp` > 1; `users` (from `module.users()`) saves recomputing it when called for many sets."""
    return tensor_split_problem(module, ops, t, users)


def degrees(
    module: Module, ops: list[Op], candidates: Iterable[int] = DEFAULT_DEGREES, users: dict[Op, list[Op]] | None = None
) -> tuple[int, ...]:
    """The `candidates` a stage holding `ops` can run at (`tp_ok`)."""
    users = users if users is not None else module.users()
    return tuple(t for t in candidates if tp_ok(module, ops, t, users) is None)


def max_degree(module: Module, ops: list[Op], candidates: Iterable[int] = DEFAULT_DEGREES) -> int:
    """The largest of `candidates` a stage holding `ops` can run at (1 always can)."""
    return max(degrees(module, ops, candidates), default=1)
