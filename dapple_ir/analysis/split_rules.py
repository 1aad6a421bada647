"""How a tensor-parallel split passes through one op, read from its kind, target and shapes.

A split is `(dim, parts)`: dimension `dim` of a value is cut into `parts` equal parts and each part into T
contiguous pieces, member k of a tensor group holding the k-th piece of each (`OpAttrs.tp_dim`). For a tuple
value (what `split` returns) the pair describes every element. The IR keeps no constant arguments (a view's
sizes, a split's dimension), so every rule reads the dimension an op acts on from its operand and result
shapes, and gives up (a reason, as text) where the shapes leave it ambiguous: an op the rules do not cover
drops the whole pattern it belongs to (`passes/tensor_parallel.py`).

Imports the IR only (no torch).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from dapple_ir.ir import FLOAT_DTYPES, NORMALISING_CALLEES, Op, OpKind, Param, TensorType, TupleType

Split = tuple[int, int]
"""(dim, parts) of a value a tensor group holds in pieces."""


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


#: Ops that act on each element alone (numpy broadcasting over several operands).
_ELEMENTWISE = _names(
    "add add_ sub sub_ mul mul_ div div_ truediv true_divide rsub neg pow exp log sqrt rsqrt tanh sigmoid "
    "relu relu_ gelu gelu_ silu silu_ mish softplus erf abs square where maximum minimum clamp clamp_min "
    "clamp_max masked_fill dropout alpha_dropout feature_dropout to type type_as float half bfloat16 double "
    "contiguous clone detach alias lift_fresh_copy _to_copy iadd imul"
)
_VIEWS = _names("view _unsafe_view reshape flatten unflatten squeeze unsqueeze")
_SWAPS = _names("transpose swapaxes t")
_PERMUTES = _names("permute movedim")
_EXPANDS = _names("expand expand_as broadcast_to")
_SLICES = _names("slice narrow getitem")
_SPLITS = _names("split split_with_sizes unsafe_split chunk tensor_split")
_CATS = _names("cat concat concatenate")
_ATTENTION = _names("scaled_dot_product_attention")
_MATMULS = _names("matmul bmm")
#: Ops that read a value without making one the pattern cares about.
_ASSERTS = frozenset({"_assert_tensor_metadata"})
_LINEARS = frozenset({"linear"})
_EMBEDDINGS = frozenset({"embedding"})
#: Losses over classes that a vocabulary-parallel head's split logits may end at (`as_class_loss`).
_CLASS_LOSSES = frozenset({"cross_entropy", "cross_entropy_loss"})
_MAX_PERMUTE_RANK = 6


def op_name(op: Op) -> str:
    """The callee's short name: `aten.view.default` and `torch._C._nn.linear` give `view` and `linear`."""
    target = op.target or ""
    if op.kind is OpKind.CALL_METHOD:
        return target
    if op.kind is not OpKind.CALL_FUNCTION:
        return ""
    parts = target.split(".")
    if parts[0] == "aten" and len(parts) >= 2:
        return parts[1]
    return parts[-1]


def is_split_op(op: Op) -> bool:
    return op_name(op) in _SPLITS


@dataclass(frozen=True)
class Linear:
    """A matmul with a weight parameter [out, in] (and a bias [out]): an `nn.Linear` call or `linear` function."""

    input: Op
    """The value multiplied by the weight (whole for a column-parallel op, split for a row-parallel one)."""
    weight: str
    """The weight parameter, [out_features, in_features]."""
    bias: str | None
    """The bias parameter, if any."""
    reads: tuple[Op, ...]
    """The `get_attr` ops that read the weight and bias (a functional or export capture; none for a module call)."""


def as_linear(op: Op, params: dict[str, Param]) -> Linear | None:
    """`op` as a linear layer, or None."""
    if op.kind is OpKind.CALL_MODULE:
        return _module_linear(op, params)
    if op_name(op) not in _LINEARS or len(op.operands) not in (2, 3):
        return None
    reads = tuple(op.operands[1:])
    if any(r.kind is not OpKind.GET_ATTR or r.target not in params for r in reads):
        return None
    weight, bias = str(reads[0].target), str(reads[1].target) if len(reads) > 1 else None
    return _checked(op, op.operands[0], params, weight, bias, reads)


def _module_linear(op: Op, params: dict[str, Param]) -> Linear | None:
    names = op.attrs.params or ()
    weight, bias = f"{op.target}.weight", f"{op.target}.bias"
    if weight not in names or not set(names) <= {weight, bias} or len(op.operands) != 1:
        return None
    return _checked(op, op.operands[0], params, weight, bias if bias in names else None, ())


def _checked(
    op: Op, x: Op, params: dict[str, Param], weight: str, bias: str | None, reads: tuple[Op, ...]
) -> Linear | None:
    """The linear if the shapes agree: x [..., in] times weight [out, in] gives [..., out]."""
    w = params[weight].type.shape
    if len(w) != 2 or not isinstance(x.type, TensorType) or not isinstance(op.type, TensorType):
        return None
    if not x.type.shape or not op.type.shape or x.type.shape[-1] != w[1] or op.type.shape[-1] != w[0]:
        return None
    if bias is not None and params[bias].type.shape != (w[0],):
        return None
    return Linear(x, weight, bias, reads)


@dataclass(frozen=True)
class Embedding:
    """A lookup of rows of a weight parameter [vocabulary, width] by integer indices: an `nn.Embedding` call or the
    `embedding` function (torch's argument order, or ATen's, weight first)."""

    indices: Op
    weight: str
    reads: tuple[Op, ...]
    """The `get_attr` op that reads the weight (a functional or export capture; none for a module call)."""

    def vocabulary(self, params: dict[str, Param]) -> int:
        return params[self.weight].type.shape[0]


def as_embedding(op: Op, params: dict[str, Param]) -> Embedding | None:
    """`op` as an embedding lookup, or None."""
    if op.kind is OpKind.CALL_MODULE:
        names = op.attrs.params or ()
        weight = f"{op.target}.weight"
        if tuple(names) != (weight,) or len(op.operands) != 1:
            return None
        found = Embedding(op.operands[0], weight, ())
    elif op_name(op) in _EMBEDDINGS and op.kind is OpKind.CALL_FUNCTION and len(op.operands) == 2:
        reads = [o for o in op.operands if o.kind is OpKind.GET_ATTR and o.target in params]
        others = [o for o in op.operands if o not in reads]
        if len(reads) != 1 or len(others) != 1:
            return None
        found = Embedding(others[0], str(reads[0].target), (reads[0],))
    else:
        return None
    w, x, y = params[found.weight].type.shape, found.indices.type, op.type
    if len(w) != 2 or not isinstance(x, TensorType) or not isinstance(y, TensorType) or x.dtype in FLOAT_DTYPES:
        return None
    return found if y.shape == (*x.shape, w[1]) else None


def as_class_loss(op: Op) -> bool:
    """Is `op` a loss over the classes of its first operand's dimension 1 (`cross_entropy` of [N, C] logits and
    [N] integer targets), whose vocabulary-parallel form sums over a tensor group (`tp_role = "loss"`)?"""
    if op.kind is not OpKind.CALL_FUNCTION or op_name(op) not in _CLASS_LOSSES or len(op.operands) < 2:
        return False
    logits, target = op.operands[0].type, op.operands[1].type
    return (
        isinstance(logits, TensorType)
        and isinstance(target, TensorType)
        and len(logits.shape) == 2
        and target.shape == logits.shape[:1]
        and target.dtype not in FLOAT_DTYPES
    )


def split_parts(op: Op) -> int:
    """Equal pieces a split op cuts its operand's last dimension into (1 if it cuts another or unevenly)."""
    source, result = op.operands[0].type if op.operands else None, op.type
    if not isinstance(source, TensorType) or not isinstance(result, TupleType) or len(result.elements) < 2:
        return 1
    last = len(source.shape) - 1
    if _cut_dim(source, result) != last or len(set(result.elements)) != 1:
        return 1
    return len(result.elements)


Rule = Callable[[Op, list[tuple[Op, Split | None]]], "Split | str | None"]


def result_split(op: Op, split_of: Callable[[Op], Split | None]) -> Split | str | None:
    """How `op`'s result is split, given how its operands are (at least one is): a split, None (whole: an
    assertion that only reads), or the reason the rules do not cover the op."""
    ins = [(o, split_of(o)) for o in op.operands]
    name = op_name(op)
    if op.kind is OpKind.CALL_MODULE and not op.attrs.params and _same_shape(op):
        return _broadcast(op, ins)  # a parameter-free module that keeps the shape: GELU, Dropout, SiLU
    if name in _ASSERTS:
        return None
    rule = _RULES.get(name)
    if rule is None or op.kind not in (OpKind.CALL_FUNCTION, OpKind.CALL_METHOD):
        return f"{_what(op)} is no op the tensor-parallel rules cover"
    if name == "getitem" and ins and isinstance(ins[0][0].type, TupleType):
        return _element(op, ins)
    return rule(op, ins)


def _what(op: Op) -> str:
    return f"%{op.name} ({op.kind.value}{' @' + op.target if op.target else ''})"


def _same_shape(op: Op) -> bool:
    tensors = [o for o in op.operands if isinstance(o.type, TensorType)]
    return len(tensors) == 1 and tensors[0].type == op.type


def _one_split(op: Op, ins: list[tuple[Op, Split | None]]) -> tuple[TensorType, Split, TensorType] | str:
    """The only tensor operand (it is split) and the result, both tensors; else why not."""
    tensors = [(o, s) for o, s in ins if isinstance(o.type, TensorType)]
    if len(tensors) != 1 or tensors[0][1] is None or not isinstance(op.type, TensorType):
        return f"{_what(op)} reads a split value with other tensors or gives no tensor"
    source, split = tensors[0]
    assert isinstance(source.type, TensorType) and split is not None
    return source.type, split, op.type


def _broadcast(op: Op, ins: list[tuple[Op, Split | None]], batch_only: bool = False) -> Split | str:
    """Elementwise (or a matmul's batch dimensions): split operands agree on the result's dimension; the
    whole ones are size 1 or absent there."""
    result = op.type
    if not isinstance(result, TensorType):
        return f"{_what(op)} gives no tensor"
    found: Split | None = None
    for o, s in ins:
        if s is None:
            continue
        t = o.type
        if not isinstance(t, TensorType) or len(t.shape) > len(result.shape):
            return f"{_what(op)} reads split %{o.name} of another shape"
        here = (s[0] + len(result.shape) - len(t.shape), s[1])
        if t.shape[s[0]] != result.shape[here[0]] or (batch_only and s[0] >= len(t.shape) - 2):
            return f"{_what(op)} reads split %{o.name} across its split dimension"
        if found is not None and found != here:
            return f"{_what(op)} reads values split on different dimensions"
        found = here
    if found is None:
        return f"{_what(op)} reads no split tensor"
    for o, s in ins:
        t = o.type
        if s is not None or not isinstance(t, TensorType):
            continue
        at = found[0] - (len(result.shape) - len(t.shape))
        if at >= 0 and t.shape[at] != 1:
            return f"{_what(op)} reads whole %{o.name} along the split dimension"
    return found


def _view(op: Op, ins: list[tuple[Op, Split | None]]) -> Split | str:
    """A view: the split dimension must lead its group of dimensions (size-1 ones aside) and maps to the
    group's first dimension in the result ([b,t,d] split on 2 -> [b,t,h,hd] split on 2)."""
    got = _one_split(op, ins)
    if isinstance(got, str):
        return got
    source, (dim, parts), result = got
    for ins_dims, out_dims in _groups(source.shape, result.shape):
        if dim in ins_dims:
            return (out_dims[0], parts) if ins_dims[0] == dim else f"{_what(op)} folds the split dimension inward"
    return f"{_what(op)} reshapes the split dimension ambiguously"


def _groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Runs of dimensions of `a` and `b` (size-1 ones left out) whose products match, by their indices."""
    xs = [i for i, n in enumerate(a) if n != 1]
    ys = [j for j, n in enumerate(b) if n != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(xs) and j < len(ys):
        gx, gy = [xs[i]], [ys[j]]
        pa, pb = a[xs[i]], b[ys[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(xs):
                gx.append(xs[i])
                pa, i = pa * a[xs[i]], i + 1
            elif pb < pa and j < len(ys):
                gy.append(ys[j])
                pb, j = pb * b[ys[j]], j + 1
            else:
                return groups  # sizes that do not multiply out: no view
        groups.append((gx, gy))
    return groups


def _permute(op: Op, ins: list[tuple[Op, Split | None]]) -> Split | str:
    """A transpose or permute: where the split dimension goes, if every order the shapes allow agrees."""
    got = _one_split(op, ins)
    if isinstance(got, str):
        return got
    source, (dim, parts), result = got
    rank = len(source.shape)
    if len(result.shape) != rank or rank > _MAX_PERMUTE_RANK:
        return f"{_what(op)} permutes a split value of rank {rank}"
    if op_name(op) in _SWAPS:
        orders = [_swap(rank, i, j) for i in range(rank) for j in range(i, rank)]
    else:
        orders = list(itertools.permutations(range(rank)))
    places = {order.index(dim) for order in orders if tuple(source.shape[k] for k in order) == result.shape}
    if len(places) != 1:
        return f"{_what(op)}: its shapes do not tell where the split dimension {dim} goes"
    return places.pop(), parts


def _swap(rank: int, i: int, j: int) -> tuple[int, ...]:
    order = list(range(rank))
    order[i], order[j] = j, i
    return tuple(order)


def _expand(op: Op, ins: list[tuple[Op, Split | None]]) -> Split | str:
    """Broadcast to a bigger shape: the split dimension keeps its size (GQA's repeat of key/value heads)."""
    first = ins[0] if ins else None
    result = op.type
    if first is None or first[1] is None or any(s is not None for _, s in ins[1:]):
        return f"{_what(op)} expands a split value other than its first operand"
    source, (dim, parts) = first[0].type, first[1]
    if not isinstance(source, TensorType) or not isinstance(result, TensorType):
        return f"{_what(op)} expands no tensor"
    at = dim + len(result.shape) - len(source.shape)
    if at < 0 or result.shape[at] != source.shape[dim]:
        return f"{_what(op)} expands the split dimension"
    return at, parts


def _slice(op: Op, ins: list[tuple[Op, Split | None]]) -> Split | str:
    """A slice along one dimension that is not the split one (rotate_half's halves of the head dimension)."""
    if not ins or ins[0][1] is None or any(s is not None for _, s in ins[1:]):
        return f"{_what(op)} slices with a split index"
    source, result, (dim, parts) = ins[0][0].type, op.type, ins[0][1]
    if not isinstance(source, TensorType) or not isinstance(result, TensorType):
        return f"{_what(op)} slices no tensor"
    if len(source.shape) != len(result.shape):
        return f"{_what(op)} indexes a split value (its rank changes)"
    cut = [k for k, (m, n) in enumerate(zip(source.shape, result.shape, strict=True)) if m != n]
    if len(cut) > 1 or dim in cut:
        return f"{_what(op)} slices the split dimension"
    return dim, parts


def _cut_dim(source: TensorType, result: TupleType) -> int | None:
    """The dimension a split op cuts (None: it returns the operand whole); -1 where the shapes disagree."""
    cut: set[int] = set()
    for element in result.elements:
        if not isinstance(element, TensorType) or len(element.shape) != len(source.shape):
            return -1
        cut |= {k for k, (m, n) in enumerate(zip(source.shape, element.shape, strict=True)) if m != n}
    return None if not cut else cut.pop() if len(cut) == 1 else -1


def _split(op: Op, ins: list[tuple[Op, Split | None]]) -> Split | str:
    """Cut into pieces: along another dimension the pieces keep the split; along the split dimension a value
    of `parts` parts cut into those parts gives pieces split in one part each (a fused QKV into q, k, v)."""
    source, result, split = ins[0][0].type if ins else None, op.type, ins[0][1] if ins else None
    if split is None or not isinstance(source, TensorType) or not isinstance(result, TupleType):
        return f"{_what(op)} splits no split tensor"
    dim, parts = split
    cut = _cut_dim(source, result)
    if cut is None or (cut != dim and cut >= 0):
        return dim, parts
    if cut == dim and parts > 1 and len(result.elements) == parts and len(set(result.elements)) == 1:
        return dim, 1
    return f"{_what(op)} cuts the split dimension into pieces the tensor group does not hold whole"


def _element(op: Op, ins: list[tuple[Op, Split | None]]) -> Split | str:
    split = ins[0][1]
    return split if split is not None else f"{_what(op)} indexes with a split value"


def _cat(op: Op, ins: list[tuple[Op, Split | None]]) -> Split | str:
    """Concatenation along a dimension other than the split one, of values split alike (empty ones aside:
    an empty key/value cache)."""
    full = [(o, s) for o, s in ins if isinstance(o.type, TensorType) and o.type.numel > 0]
    result = op.type
    if not full or not isinstance(result, TensorType) or len({s for _, s in full}) != 1 or full[0][1] is None:
        return f"{_what(op)} joins split and whole values"
    dim, parts = full[0][1]
    for o, _ in full:
        assert isinstance(o.type, TensorType)
        if len(o.type.shape) != len(result.shape) or o.type.shape[dim] != result.shape[dim]:
            return f"{_what(op)} joins along the split dimension"
    return dim, parts


def _attention(op: Op, ins: list[tuple[Op, Split | None]]) -> Split | str:
    """Attention over heads: query, key and value split on their heads dimension (the third from last),
    a mask whole with size 1 (or nothing) there."""
    tensors = [(o, s) for o, s in ins if isinstance(o.type, TensorType)]
    result = op.type
    if len(tensors) < 3 or not isinstance(result, TensorType) or len(result.shape) < 3:
        return f"{_what(op)} is attention without query, key and value tensors"
    heads = (len(result.shape) - 3, 1)
    if any(s != heads for _, s in tensors[:3]):
        return f"{_what(op)} reads query, key and value not all split on their heads"
    rest = _broadcast(op, [tensors[0], *[(o, s) for o, s in tensors[3:]]])
    return rest if isinstance(rest, str) else heads


def _matmul(op: Op, ins: list[tuple[Op, Split | None]]) -> Split | str:
    return _broadcast(op, ins, batch_only=True)


def _normalise(op: Op, ins: list[tuple[Op, Split | None]]) -> Split | str:
    """Softmax along a dimension (`OpAttrs.dim`) other than the split one: each member normalises its own rows
    (attention probabilities over keys, split by heads); a mask read whole broadcasts (`_broadcast`)."""
    got = _broadcast(op, ins)
    if isinstance(got, str):
        return got
    dim, parts = got
    if op.attrs.dim is None:
        return f"{_what(op)} normalises along a dimension the capture did not record"
    if op.attrs.dim == dim:
        return f"{_what(op)} normalises along the split dimension"
    return dim, parts


_RULES: dict[str, Rule] = {
    **dict.fromkeys(_ELEMENTWISE, _broadcast),
    **dict.fromkeys(_VIEWS, _view),
    **dict.fromkeys(_SWAPS | _PERMUTES, _permute),
    **dict.fromkeys(_EXPANDS, _expand),
    **dict.fromkeys(_SLICES, _slice),
    **dict.fromkeys(_SPLITS, _split),
    **dict.fromkeys(_CATS, _cat),
    **dict.fromkeys(_ATTENTION, _attention),
    **dict.fromkeys(_MATMULS, _matmul),
    **dict.fromkeys(NORMALISING_CALLEES, _normalise),
}
