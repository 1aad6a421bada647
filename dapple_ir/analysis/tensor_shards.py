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

from dapple_ir.ir import Module, Op, OpKind, Param, TensorType, TupleType

#: Degrees a tensor group may have by default: powers of two up to a node's eight devices.
DEFAULT_DEGREES: tuple[int, ...] = (1, 2, 4, 8)


def is_sharded(op: Op) -> bool:
    """Does each member of a tensor group compute only its piece of `op` (a role or a split result)?"""
    return op.attrs.tp_role is not None or op.attrs.tp_dim is not None


def sharded_ops(ops: Iterable[Op]) -> list[Op]:
    """The ops whose FLOPs and activation bytes divide by T on a tensor group of T."""
    return [op for op in ops if is_sharded(op)]


def forward_reduces(ops: Iterable[Op]) -> list[Op]:
    """The row-parallel ops of `ops`: each sums its result (its bytes) over the group in the forward."""
    return [op for op in ops if op.attrs.tp_role == "row"]


def backward_reduces(ops: Iterable[Op]) -> list[Op]:
    """The distinct whole inputs of the column-parallel ops of `ops`: the gradient of each (its bytes) is
    summed over the group in the backward, once however many column-parallel ops read it."""
    seen: dict[Op, None] = {}
    for op in ops:
        if op.attrs.tp_role == "col" and op.operands:
            seen.setdefault(op.operands[0], None)
    return list(seen)


def is_split(op: Op) -> bool:
    """Is `op`'s value held in pieces by a tensor group (not a parameter read: every stage loads its own)?"""
    return op.attrs.tp_dim is not None and op.kind is not OpKind.GET_ATTR


def crosses_split(values: Iterable[Op]) -> Op | None:
    """The first of `values` (those crossing a stage boundary) that a tensor group holds in pieces: a cut
    there would fall inside a tensor-parallel pattern. None where no value is split."""
    return next((v for v in values if is_split(v)), None)


def split_params(module: Module, ops: Iterable[Op]) -> list[Param]:
    """The parameters `ops` read that a tensor group holds in pieces (`ParamAttrs.tp_dim`), once each."""
    table = {p.name: p for p in module.params}
    names: dict[str, None] = {}
    for op in ops:
        for name in op.attrs.params or ():
            names.setdefault(name, None)
        if op.kind is OpKind.GET_ATTR and op.target is not None:
            names.setdefault(op.target, None)
    return [table[n] for n in names if n in table and table[n].attrs.tp_dim is not None]


def tp_ok(module: Module, ops: list[Op], t: int, users: dict[Op, list[Op]] | None = None) -> str | None:
    """None if a stage holding `ops` can run on a tensor group of `t`, else a one-line reason naming the op
    or parameter: every split dimension (of results, parameters) divides into `tp_parts` * `t` pieces, and no
    split value enters or leaves the set (a pattern cut by a stage boundary). `users` (from `module.users()`)
    saves recomputing it when called for many sets."""
    if t == 1:
        return None
    for op in ops:
        reason = _result_reason(op, t)
        if reason:
            return reason
    for p in split_params(module, ops):
        reason = _divides(f"parameter @{p.name}", p.type.shape, p.attrs.tp_dim, p.attrs.tp_parts, t)
        if reason:
            return reason
    return _boundary_reason(module, ops, users)


def _result_reason(op: Op, t: int) -> str | None:
    if not is_split(op):
        return None
    shapes = [op.type.shape] if isinstance(op.type, TensorType) else []
    if isinstance(op.type, TupleType):
        shapes = [e.shape for e in op.type.elements if isinstance(e, TensorType)]
    for shape in shapes:
        reason = _divides(f"op %{op.name}", shape, op.attrs.tp_dim, op.attrs.tp_parts, t)
        if reason:
            return reason
    return None


def _divides(what: str, shape: tuple[int, ...], dim: int | None, parts: int | None, t: int) -> str | None:
    if dim is None:
        return None
    if not 0 <= dim < len(shape):
        return f"{what} splits dimension {dim}, which its shape {list(shape)} does not have"
    size, parts = shape[dim], parts or 1
    if size % (parts * t) == 0:
        return None
    if parts > 1 and size % parts == 0:
        size_text = f"size {size}: {parts} parts of {size // parts}, which is"
    else:
        size_text = f"size {size}, which is"
    return f"{what} splits dimension {dim} of {list(shape)} ({size_text} not a multiple of T = {t})"


def _boundary_reason(module: Module, ops: list[Op], users: dict[Op, list[Op]] | None) -> str | None:
    inside = set(ops)
    for op in ops:
        outer = next((o for o in op.operands if is_split(o) and o not in inside), None)
        if outer is not None:
            return f"op %{op.name} reads split %{outer.name} from outside the stage (a cut inside a pattern)"
    if not any(is_split(op) for op in ops):
        return None
    users = users if users is not None else module.users()
    for op in ops:
        reader = next((u for u in users.get(op, ()) if u not in inside), None) if is_split(op) else None
        if reader is not None:
            return f"split %{op.name} is read by %{reader.name} outside the stage (a cut inside a pattern)"
    return None


def degrees(
    module: Module, ops: list[Op], candidates: Iterable[int] = DEFAULT_DEGREES, users: dict[Op, list[Op]] | None = None
) -> tuple[int, ...]:
    """The `candidates` a stage holding `ops` can run at (`tp_ok`)."""
    users = users if users is not None else module.users()
    return tuple(t for t in candidates if tp_ok(module, ops, t, users) is None)


def max_degree(module: Module, ops: list[Op], candidates: Iterable[int] = DEFAULT_DEGREES) -> int:
    """The largest of `candidates` a stage holding `ops` can run at (1 always can)."""
    return max(degrees(module, ops, candidates), default=1)
