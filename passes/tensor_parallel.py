"""Find Megatron-LM's tensor-parallel patterns and mark their ops and parameters with how they split."""

from __future__ import annotations

from dataclasses import dataclass, field

from dapple_ir.analysis.split_rules import (
    Embedding,
    Linear,
    Split,
    as_class_loss,
    as_embedding,
    as_linear,
    is_split_op,
    op_name,
    result_split,
    split_parts,
)
from dapple_ir.analysis.tensor_shards import DEFAULT_DEGREES
from dapple_ir.ir import FLOAT_DTYPES, Module, Op, OpKind, TensorType
from dapple_ir.registry import Pass, PassContext, register_pass

#: A vocabulary (an embedding's rows, a cross-entropy's classes) splits only if it is a multiple of this: every
#: degree a tensor group may have divides it, so the split never keeps a stage from a degree its blocks allow.
VOCAB_MULTIPLE = max(DEFAULT_DEGREES)


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
    reduction, the model's output) is dropped whole: its ops stay replicated.

    The vocabulary splits too, as Megatron-LM's `VocabParallelEmbedding`, LM head and
    `vocab_parallel_cross_entropy` split it: an embedding lookup (`tp_role = "vocab"`: weight split on its rows,
    each member looks up the indices in its range, zeros elsewhere, and the group sums the rows in the forward);
    an LM head is a column-parallel linear (tied to an embedding's weight or not) whose split logits end at a
    cross-entropy over them (`tp_role = "loss"`: each member's log-sum-exp and target logit of its classes, summed
    over the group in the forward; the backward needs no sum). A tied weight splits only where every op reading it
    does. Only a vocabulary that every degree divides splits (`VOCAB_MULTIPLE`: Megatron pads its vocabulary
    instead; this pass does not change the model). The marks do not depend on the degree: each stage's `tp`
    (planner) decides whether they are used (`dapple_ir.analysis.tensor_shards.tp_ok`).
    """

    name = "tensor-parallel"

    def apply(self, ctx: PassContext, module: Module) -> None:
        _clear(module)
        found, linears = find_patterns(module)
        _annotate(module, found, linears)
        roles = list(found.roles.values())
        ctx.log(
            f"tensor-parallel: {roles.count('col')} column- and {roles.count('row')} row-parallel matmuls, "
            f"{roles.count('vocab')} vocabulary-parallel embedding(s), {roles.count('loss')} cross-entropy, "
            f"{len(found.splits)} split values"
        )
        for reason in found.reasons:
            ctx.log(f"tensor-parallel: left a pattern replicated: {reason}")


@dataclass
class Patterns:
    """What one search found: each split value's split, each linear's role, the linears by op."""

    splits: dict[Op, Split] = field(default_factory=dict)
    """How each value of a pattern is split (a column-parallel result on its last dimension)."""
    roles: dict[Op, str] = field(default_factory=dict)
    """`col` or `row` for each linear of a pattern, `loss` for a cross-entropy over split classes, `vocab` for an
    embedding whose weight splits on its rows."""
    embeddings: dict[Op, Embedding] = field(default_factory=dict)
    """The embeddings that split (`vocab`)."""
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
    readers = _readers(module)
    embeddings = {
        op: emb
        for op in module.ops
        if (emb := as_embedding(op, params)) and emb.vocabulary(params) % VOCAB_MULTIPLE == 0 and _looks_up_input(emb)
    }
    # A linear that shares its weight splits only as a tied LM head: the weight's other readers all embeddings.
    lookups = set(embeddings) | {r for emb in embeddings.values() for r in emb.reads}
    linears = {
        op: lin for op in module.ops if (lin := as_linear(op, params)) and _owns(op, lin, lookups, readers, users)
    }
    seeds = {op: _fused_parts(op, users) for op, lin in linears.items() if _is_float(lin.input)}
    reasons: list[str] = []
    while True:
        found = _grow(module, linears, seeds, users)
        reasons += found.reasons
        if not found.failed_seeds:
            found.reasons = reasons
            heads = {linears[op].weight for op, role in found.roles.items() if role == "col"}
            found.embeddings = {
                op: emb
                for op, emb in embeddings.items()
                if all(r in embeddings or r.target in heads for r in readers[emb.weight] if r not in emb.reads)
            }
            found.roles.update(dict.fromkeys(found.embeddings, "vocab"))
            return found, linears
        for op in found.failed_seeds:
            del seeds[op]


def _looks_up_input(emb: Embedding) -> bool:
    """Does the embedding look up the model's input (token ids, through views), as a word embedding does? A position
    embedding's indices are computed (`arange`): Megatron keeps it whole, and so does this pass."""
    value = emb.indices
    while value.kind is not OpKind.INPUT:
        if op_name(value) not in ("view", "reshape", "flatten", "contiguous") or len(value.operands) != 1:
            return False
        value = value.operands[0]
    return True


def _readers(module: Module) -> dict[str, list[Op]]:
    """The ops that read each parameter: those listing it (`OpAttrs.params`) and the `get_attr` ops of it."""
    found: dict[str, list[Op]] = {p.name: [] for p in module.params}
    for op in module.ops:
        for name in op.read_params:
            if name in found:
                found[name].append(op)
    return found


def _owns(op: Op, lin: Linear, lookups: set[Op], readers: dict[str, list[Op]], users: dict[Op, list[Op]]) -> bool:
    """May the linear's weight and bias split: no op reads them but the linear (through its own get_attr ops, each
    read once) and `lookups`, the splittable embeddings of the weight and their reads (a tied LM head)?"""
    if not all(len(users[r]) == 1 for r in lin.reads):
        return False
    owned = [lin.weight] + ([lin.bias] if lin.bias else [])
    return all(
        r is op or r in lin.reads or (name == lin.weight and r in lookups) for name in owned for r in readers[name]
    )


def _is_float(value: Op) -> bool:
    return isinstance(value.type, TensorType) and value.type.dtype in FLOAT_DTYPES


def _fused_parts(op: Op, users: dict[Op, list[Op]]) -> int:
    """Parts of a fused projection: 3 where its readers all cut the result into three equal pieces (QKV)."""
    readers = users.get(op, [])
    parts = {split_parts(u) for u in readers if is_split_op(u)}
    return parts.pop() if len(parts) == 1 and all(is_split_op(u) for u in readers) else 1


def _grow(module: Module, linears: dict[Op, Linear], seeds: dict[Op, int], users: dict[Op, list[Op]]) -> Patterns:
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
        if as_class_loss(op) and split_in == [op.operands[0]]:
            reason = _loss_problem(op, found.splits[op.operands[0]])
            (failed if reason else closed).append(op)
            found.reasons += [reason] if reason else []
            found.roles[op] = "loss"
            continue
        if op_name(op) == "getattr":
            reason = _shape_read_problem(op, users)
            if reason:
                found.reasons.append(reason)
                failed.append(op)
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


def _loss_problem(op: Op, split: Split) -> str | None:
    """Why a cross-entropy cannot close a pattern at its split logits (None: it can): they must be split on the
    class dimension, in one part, over a vocabulary `VOCAB_MULTIPLE` divides."""
    logits = op.operands[0].type
    assert isinstance(logits, TensorType)
    if split != (1, 1):
        return f"%{op.name} (cross-entropy) reads logits split on dimension {split[0]}, not on their classes"
    if logits.shape[1] % VOCAB_MULTIPLE:
        return (
            f"%{op.name} (cross-entropy) over {logits.shape[1]} classes: a vocabulary splits only as a multiple of "
            f"{VOCAB_MULTIPLE}"
        )
    return None


def _shape_read_problem(op: Op, users: dict[Op, list[Op]]) -> str | None:
    """A split value's shape (`x.shape`) may only give sizes to views: each member reads its own extent of the
    split dimension, which is right as a view's size along it and wrong anywhere else."""
    for item in users.get(op, []):
        for user in users.get(item, []):
            if op_name(item) != "getitem" or op_name(user) not in ("view", "reshape"):
                return f"%{op.name} reads the shape of a split value for %{user.name}, not for a view's sizes"
    return None


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
    for emb in found.embeddings.values():
        params[emb.weight].attrs.tp_dim = 0
        for read in emb.reads:
            read.attrs.tp_dim = 0
    for op, role in found.roles.items():
        op.attrs.tp_role = role
        if role in ("vocab", "loss"):
            continue
        lin = linears[op]
        parts = found.splits[op][1] if role == "col" else 1
        split = {lin.weight: 0, **({lin.bias: 0} if lin.bias else {})} if role == "col" else {lin.weight: 1}
        for name, dim in split.items():
            params[name].attrs.tp_dim, params[name].attrs.tp_parts = dim, parts if parts > 1 else None
        for read in lin.reads:
            if read.target in split:
                read.attrs.tp_dim, read.attrs.tp_parts = split[str(read.target)], parts if parts > 1 else None
