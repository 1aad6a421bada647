"""Find Megatron-LM's tensor-parallel patterns and mark their ops and parameters with how they split."""

from __future__ import annotations

from dataclasses import dataclass, field

from dapple_ir.analysis.split_rules import Linear, Split, as_linear, is_split_op, result_split, split_parts
from dapple_ir.ir import FLOAT_DTYPES, Module, Op, Param, TensorType
from dapple_ir.registry import Pass, PassContext, register_pass


@register_pass
@dataclass(frozen=True)
class TensorParallel(Pass):
    """Mark Megatron-LM's column- and row-parallel matmul pairs and the ops between them (`tp_role`, `tp_dim`).

    A pattern starts at column-parallel linears (`tp_role = "col"`: weight and bias split on the output
    features, input whole), one or several reading the same whole value (q/k/v, gate/up projections), and
    ends at row-parallel linears (`tp_role = "row"`: weight split on the input features, input split on its
    last dimension, result summed over the tensor group). Between them every value keeps a split that the
    rules follow from op kinds and shapes (`dapple_ir.analysis.split_rules`): elementwise ops (activations,
    dropout, SwiGLU's product, rotary arithmetic with whole values broadcast along the split), views that map
    the split onto heads, transposes and permutes, split/chunk and slices along other dimensions (a fused QKV
    split into q, k and v gives `tp_parts = 3`), concatenation, GQA's key/value expansion, and attention with
    query, key and value split on their heads. A pattern with a split value that reaches any other op (a
    reduction, the loss, the model's output) is dropped whole: its ops stay replicated. The embedding and the
    LM head always stay replicated (no vocabulary-parallel embedding or cross-entropy). The marks do not
    depend on the degree: each stage's `tp` (planner) decides whether they are used
    (`dapple_ir.analysis.tensor_shards.tp_ok`).
    """

    name = "tensor-parallel"

    def apply(self, ctx: PassContext, module: Module) -> None:
        _clear(module)
        found, linears = find_patterns(module)
        _annotate(module, found, linears)
        cols = sum(role == "col" for role in found.roles.values())
        rows = len(found.roles) - cols
        ctx.log(f"tensor-parallel: {cols} column- and {rows} row-parallel matmuls, {len(found.splits)} split values")
        for reason in found.reasons:
            ctx.log(f"tensor-parallel: left a pattern replicated: {reason}")


@dataclass
class Patterns:
    """What one search found: each split value's split, each linear's role, the linears by op."""

    splits: dict[Op, Split] = field(default_factory=dict)
    """How each value of a pattern is split (a column-parallel result on its last dimension)."""
    roles: dict[Op, str] = field(default_factory=dict)
    """`col` or `row` for each linear of a pattern."""
    failed_seeds: set[Op] = field(default_factory=set)
    """Column-parallel candidates whose pattern reached an op the rules do not cover, or never closed."""
    reasons: list[str] = field(default_factory=list)
    """Why patterns were dropped, one line per op that stopped one."""


def find_patterns(module: Module) -> tuple[Patterns, dict[Op, Linear]]:
    """Megatron's patterns in `module`: grow every candidate from its column-parallel linears, drop the ones
    that reach an op no rule covers, and search again without them (their ops are whole now, and may feed
    other patterns)."""
    params = {p.name: p for p in module.params}
    users = module.users()
    # A linear that shares its weight (a tied LM head) never splits: neither starts nor closes a pattern.
    linears = {op: lin for op in module.ops if (lin := as_linear(op, params)) and _owns(lin, params, users)}
    seeds = {op: _fused_parts(op, users) for op, lin in linears.items() if _is_float(lin.input)}
    reasons: list[str] = []
    while True:
        found = _grow(module, linears, seeds)
        reasons += found.reasons
        if not found.failed_seeds:
            found.reasons = reasons
            return found, linears
        for op in found.failed_seeds:
            del seeds[op]


def _owns(lin: Linear, params: dict[str, Param], users: dict[Op, list[Op]]) -> bool:
    """Does the linear alone read its weight and bias (not tied, each get_attr read once), so they may split?"""
    owned = [lin.weight] + ([lin.bias] if lin.bias else [])
    return not any(params[name].attrs.shared for name in owned) and all(len(users[r]) == 1 for r in lin.reads)


def _is_float(value: Op) -> bool:
    return isinstance(value.type, TensorType) and value.type.dtype in FLOAT_DTYPES


def _fused_parts(op: Op, users: dict[Op, list[Op]]) -> int:
    """Parts of a fused projection: 3 where its readers all cut the result into three equal pieces (QKV)."""
    readers = users.get(op, [])
    parts = {split_parts(u) for u in readers if is_split_op(u)}
    return parts.pop() if len(parts) == 1 and all(is_split_op(u) for u in readers) else 1


def _grow(module: Module, linears: dict[Op, Linear], seeds: dict[Op, int]) -> Patterns:
    """One forward sweep: splits from the seeds, patterns as union-find components, failures per component."""
    found = Patterns()
    parent: dict[Op, Op] = {}

    def root(op: Op) -> Op:
        while parent.setdefault(op, op) is not op:
            parent[op] = parent[parent[op]]
            op = parent[op]
        return op

    failed: list[Op] = []
    closed: list[Op] = []
    for op in module.ops:
        split_in = [o for o in op.operands if o in found.splits]
        lin = linears.get(op)
        if not split_in:
            if op in seeds and isinstance(op.type, TensorType):
                found.splits[op] = (len(op.type.shape) - 1, seeds[op])
                found.roles[op] = "col"
            continue
        for o in split_in:
            parent[root(op)] = root(o)
        if lin is not None and split_in == [lin.input]:
            (closed if found.splits[lin.input] == (_last(lin.input), 1) else failed).append(op)
            found.roles[op] = "row"
            continue
        result = result_split(op, found.splits.get)
        if isinstance(result, str):
            found.reasons.append(result)
            failed.append(op)
        elif result is not None:
            found.splits[op] = result
    bad, good = {root(op) for op in failed}, {root(op) for op in closed}
    cols = [op for op, role in found.roles.items() if role == "col"]
    found.failed_seeds = {op for op in cols if root(op) in bad or root(op) not in good}
    return found


def _last(op: Op) -> int:
    return len(op.type.shape) - 1 if isinstance(op.type, TensorType) else -1


def _clear(module: Module) -> None:
    for op in module.ops:
        op.attrs.tp_role = op.attrs.tp_dim = op.attrs.tp_parts = None
    for p in module.params:
        p.attrs.tp_dim = p.attrs.tp_parts = None


def _annotate(module: Module, found: Patterns, linears: dict[Op, Linear]) -> None:
    """Set the ops' and parameters' attributes (and the get_attr ops' that read the split parameters)."""
    params = {p.name: p for p in module.params}
    for op, (dim, parts) in found.splits.items():
        op.attrs.tp_dim, op.attrs.tp_parts = dim, parts if parts > 1 else None
    for op, role in found.roles.items():
        op.attrs.tp_role = role
        lin = linears[op]
        parts = found.splits[op][1] if role == "col" else 1
        split = {lin.weight: 0, **({lin.bias: 0} if lin.bias else {})} if role == "col" else {lin.weight: 1}
        for name, dim in split.items():
            params[name].attrs.tp_dim, params[name].attrs.tp_parts = dim, parts if parts > 1 else None
        for read in lin.reads:
            if read.target in split:
                read.attrs.tp_dim, read.attrs.tp_parts = split[str(read.target)], parts if parts > 1 else None
