"""A tensor-parallel stage's fx graph rewritten to compute one member's shard (see `tensor_parallel`).

The stage's graph is the captured one (node names are IR op names), holding the member's parameter slices
already. Three rewrites, read off the IR ops' `tp_role` and `tp_dim`:

- a column-parallel op (`tp_role = "col"`) reads its whole input through f (`GroupGradSum`), one per distinct
  input node: Llama's q, k and v projections share one. It runs as captured, on its sliced weight and bias.
- a row-parallel op (`tp_role = "row"`: a linear, as a module, `F.linear` or ATen's `linear`) becomes the
  linear without its bias on the sliced weight, g (`GroupSum`), then `torch.add` of the whole bias: the node
  keeps its name and its users.
- an op whose result is split (`tp_dim`) and whose arguments spell out sizes gets the size of the split
  dimension divided by T: `view`/`reshape`/`expand` the entry at `tp_dim` (a constant divided here, -1 left
  as is, a size the graph computes from a whole tensor's shape divided by a `floordiv` node inserted before),
  `split` its split size(s) where it splits along `tp_dim`. The captured graph holds whole sizes (or computes
  them from the shapes of whole tensors: GPT's `split(d)` and `reshape(b, t, d)` read `d` off the block's
  input); a size computed from an already split tensor's shape is not supported. Slicing or concatenating
  along the split dimension is refused, naming the op.
- an op with a split result that draws random numbers (dropout) draws on whole-shaped tensors and keeps its
  slice (`tensor_draws`), so its numbers are one device's.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

from dapple_ir.backends.torch.stage_module import StageModule
from dapple_ir.backends.torch.tensor_draws import draw_whole, draws
from dapple_ir.backends.torch.tensor_parallel import (
    GroupGradSum,
    GroupSum,
    TensorGroup,
    VocabCrossEntropy,
    VocabLookup,
    slice_params,
)
from dapple_ir.errors import DappleError
from dapple_ir.ir import Module, Op, TensorType, TupleType

#: Callees whose size arguments list the result's extents, one per dimension.
_SHAPED = frozenset({"view", "reshape", "expand", "_unsafe_view"})
#: Callees that split their input along a dimension into pieces of given sizes.
_SPLITS = frozenset({"split", "split_with_sizes"})
#: Callees that take a dimension and would mix the members' slices if it were the split one.
_ALONG_DIM = frozenset({"slice", "narrow", "cat", "concat", "concatenate", "select", "index_select"})
#: Linear callees a row-parallel op may be (besides an `nn.Linear` submodule).
_LINEARS = frozenset({"linear"})


def shard_graph(graph_module: torch.fx.GraphModule, ops: dict[str, Op], group: TensorGroup) -> None:
    """Rewrite the stage's graph in place for member `group.member` of `group.size` (module docstring)."""
    graph = graph_module.graph
    whole_inputs: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in list(graph.nodes):
        op = ops.get(node.name)
        if op is None or node.op not in ("call_module", "call_function", "call_method"):
            continue
        if op.attrs.tp_role == "col":
            _read_through_f(graph_module, node, group, whole_inputs)
        elif op.attrs.tp_role == "row":
            _row_parallel(graph_module, node, group)
        elif op.attrs.tp_role == "vocab":
            _vocab_embedding(graph_module, node, group)
        elif op.attrs.tp_role == "loss":
            _vocab_loss(graph_module, node, group)
        elif op.attrs.tp_role is not None:
            raise DappleError(
                f"%{node.name} has tp_role = {op.attrs.tp_role!r}: the runtime knows col, row, vocab and loss"
            )
        elif op.attrs.tp_dim is not None and draws(graph_module, node, _callee(node)):
            draw_whole(node, ops, group.member, group.size)
        elif op.attrs.tp_dim is not None:
            _local_sizes(node, op, group.size, ops)
    graph.lint()
    graph_module.recompile()


def _callee(node: torch.fx.Node) -> str:
    """The bare name of what a node calls: `view` for `x.view`, `aten.view.default` and `torch.Tensor.view`."""
    if isinstance(node.target, str):
        return node.target.rsplit(".", 1)[-1]
    packet = getattr(node.target, "_overloadpacket", None)
    return str(getattr(packet or node.target, "__name__", node.target))


def _read_through_f(
    graph_module: torch.fx.GraphModule,
    node: torch.fx.Node,
    group: TensorGroup,
    whole_inputs: dict[torch.fx.Node, torch.fx.Node],
) -> None:
    """A column-parallel op's whole input (its first argument) through f, shared with the ops reading it too."""
    whole = node.args[0] if node.args else None
    if not isinstance(whole, torch.fx.Node):
        raise DappleError(f"column-parallel op %{node.name} has no input value to split the gradient of")
    if whole not in whole_inputs:
        name = f"tp_grad_sum_{whole.name}"
        graph_module.add_submodule(name, GroupGradSum(group, whole.name))
        with graph_module.graph.inserting_before(node):
            whole_inputs[whole] = graph_module.graph.call_module(name, (whole,))
    node.args = (whole_inputs[whole], *node.args[1:])


def _row_parallel(graph_module: torch.fx.GraphModule, node: torch.fx.Node, group: TensorGroup) -> None:
    """linear(x, W_k) summed by g, then + bias: the node becomes the addition (or g itself without a bias)."""
    graph = graph_module.graph
    x, weight, bias = _linear_parts(graph_module, node)
    name = f"tp_sum_{node.name}"
    graph_module.add_submodule(name, GroupSum(group, node.name))
    with graph.inserting_before(node):
        w = graph.get_attr(weight) if isinstance(weight, str) else weight
        linear = graph.call_function(torch.nn.functional.linear, (x, w))
        if bias is None:
            node.op, node.target, node.args, node.kwargs = "call_module", name, (linear,), {}
            return
        total = graph.call_module(name, (linear,))
        b = graph.get_attr(bias) if isinstance(bias, str) else bias
    node.op, node.target, node.args, node.kwargs = "call_function", torch.add, (total, b), {}


def _vocab_embedding(graph_module: torch.fx.GraphModule, node: torch.fx.Node, group: TensorGroup) -> None:
    """An embedding lookup becomes `VocabLookup` of its indices in this member's rows of the (sliced) weight."""
    graph = graph_module.graph
    indices: Any
    weight: Any
    pad: Any = None
    if node.op == "call_module":
        sub = graph_module.get_submodule(str(node.target))
        if not isinstance(sub, torch.nn.Embedding) or sub.max_norm is not None or sub.scale_grad_by_freq:
            raise DappleError(
                f"vocabulary-parallel %{node.name} calls {type(sub).__name__}: the runtime splits an nn.Embedding "
                "without max_norm or scale_grad_by_freq"
            )
        indices, weight, pad = node.args[0], f"{node.target}.weight", sub.padding_idx
    elif _callee(node) == "embedding" and str(node.target).startswith("aten."):
        weight, indices, *rest = node.args  # ATen's order: weight, indices, padding_idx, scale_grad_by_freq, sparse
        pad = rest[0] if rest and rest[0] != -1 else None
        _defaults(node, rest[1:], [False, False])
    elif _callee(node) == "embedding":
        indices, weight, *rest = node.args
        pad = rest[0] if rest else node.kwargs.get("padding_idx")
        if isinstance(pad, int) and pad < 0:
            raise DappleError(f"vocabulary-parallel %{node.name} counts its padding_idx from the end: give it >= 0")
        _defaults(node, rest[1:], [None, 2.0, False, False])
    else:
        raise DappleError(f"vocabulary-parallel %{node.name} calls {node.target}: the runtime splits embeddings only")
    name = f"tp_vocab_{node.name}"
    graph_module.add_submodule(name, VocabLookup(group, node.name, pad))
    with graph.inserting_before(node):
        w = graph.get_attr(weight) if isinstance(weight, str) else weight
    node.op, node.target, node.args, node.kwargs = "call_module", name, (indices, w), {}


def _defaults(node: torch.fx.Node, given: list[Any], defaults: list[Any]) -> None:
    """Refuse an embedding whose optional arguments (positional or by keyword) are not their defaults."""
    options = {k: v for k, v in node.kwargs.items() if k != "padding_idx"}
    if any(g != d for g, d in zip(given, defaults, strict=False)) or any(
        v not in (None, False, 2.0) for v in options.values()
    ):
        raise DappleError(
            f"vocabulary-parallel %{node.name} passes options to its embedding: the runtime splits a plain lookup"
        )


#: torch's reduction names by ATen's enum (`aten.cross_entropy_loss`'s `reduction` argument).
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _vocab_loss(graph_module: torch.fx.GraphModule, node: torch.fx.Node, group: TensorGroup) -> None:
    """A cross-entropy of split logits becomes `VocabCrossEntropy` with the call's reduction and ignored index;
    class weights and label smoothing are refused by name."""
    aten = str(node.target).startswith("aten.")
    names = (
        ["input", "target", "weight", "reduction", "ignore_index", "label_smoothing"]
        if aten
        else ["input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing"]
    )
    given: dict[str, Any] = {**dict(zip(names, node.args, strict=False)), **node.kwargs}
    if given.get("weight") is not None or given.get("label_smoothing", 0.0) or given.get("size_average") is not None:
        raise DappleError(
            f"cross-entropy %{node.name} over split classes passes class weights, label smoothing or size_average: "
            "the runtime's vocabulary-parallel cross-entropy takes a reduction and ignore_index only"
        )
    if given.get("reduce") is not None:
        raise DappleError(f"cross-entropy %{node.name} passes the deprecated reduce=: use reduction=")
    reduction = given.get("reduction", 1 if aten else "mean")
    reduction = _REDUCTIONS.get(reduction, reduction) if aten else reduction
    name = f"tp_loss_{node.name}"
    graph_module.add_submodule(
        name, VocabCrossEntropy(group, node.name, str(reduction), int(given.get("ignore_index", -100)))
    )
    node.op, node.target, node.args, node.kwargs = "call_module", name, (given["input"], given["target"]), {}


def _linear_parts(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[Any, Any, Any]:
    """(input, weight, bias) of a linear node: nodes, or attribute paths for an `nn.Linear` submodule's."""
    if node.op == "call_module":
        sub = graph_module.get_submodule(str(node.target))
        if not isinstance(sub, torch.nn.Linear):
            raise DappleError(
                f"row-parallel op %{node.name} calls a {type(sub).__name__}: the runtime splits linear layers only"
            )
        return node.args[0], f"{node.target}.weight", f"{node.target}.bias" if sub.bias is not None else None
    if _callee(node) not in _LINEARS:
        raise DappleError(f"row-parallel op %{node.name} calls {node.target}: the runtime splits linear layers only")
    args = list(node.args) + [None] * (3 - len(node.args))
    return args[0], args[1], node.kwargs.get("bias", args[2])


def _local_sizes(node: torch.fx.Node, op: Op, tp: int, ops: dict[str, Op]) -> None:
    """Divide the size arguments of the split dimension by `tp` (module docstring), but for sizes read off a split
    value's shape: the member's extent already."""
    dim = op.attrs.tp_dim
    assert dim is not None
    callee = _callee(node)
    rank = _rank_of(op)
    if rank is not None:
        dim %= rank
    if callee in _SHAPED:
        _local_shape(node, dim, tp, ops)
    elif callee in _SPLITS:
        _local_split(node, dim, tp, rank)
    elif callee in _ALONG_DIM:
        along = _dim_arg(node, 1, rank)
        if along == dim:
            raise DappleError(
                f"%{node.name} ({callee}) works along dimension {dim}, which its tensor group splits: the runtime "
                "cannot run it on slices; leave this op out of the tensor-parallel pattern"
            )


def _rank_of(op: Op) -> int | None:
    t = op.type
    if isinstance(t, TupleType) and t.elements and isinstance(t.elements[0], TensorType):
        t = t.elements[0]
    return len(t.shape) if isinstance(t, TensorType) else None


def _dim_arg(node: torch.fx.Node, position: int, rank: int | None) -> int | None:
    """The `dim` argument of a node (positional at `position` or by keyword), normalised by `rank`."""
    value = node.kwargs.get("dim", node.args[position] if len(node.args) > position else 0)
    if not isinstance(value, int):
        return None
    return value % rank if rank else value


def _local_shape(node: torch.fx.Node, dim: int, tp: int, ops: dict[str, Op]) -> None:
    """view/reshape/expand: the size of dimension `dim` divided by `tp`, in any of the argument spellings."""
    spelled = node.args[1] if len(node.args) == 2 else None
    listed = isinstance(spelled, list | tuple)
    sizes: list[Any] = list(spelled) if isinstance(spelled, list | tuple) else list(node.args[1:])
    if "size" in node.kwargs or "shape" in node.kwargs:
        raise DappleError(f"%{node.name} gives its sizes by keyword: the runtime cannot split it over a tensor group")
    if dim >= len(sizes):
        raise DappleError(f"%{node.name} lists {len(sizes)} sizes; its tensor group splits dimension {dim}")
    if not _read_off_split(sizes[dim], ops):
        sizes[dim] = _local_size(node, sizes[dim], tp)
    node.args = (
        (node.args[0], tuple(sizes) if isinstance(spelled, tuple) else sizes) if listed else (node.args[0], *sizes)
    )


def _read_off_split(size: Any, ops: dict[str, Op]) -> bool:
    """Is `size` an extent of a split value's shape (`x.shape[i]`, `x.size(i)`), so already the member's own?"""
    if not isinstance(size, torch.fx.Node) or not size.args or not isinstance(size.args[0], torch.fx.Node):
        return False
    source: Any = size.args[0]
    if size.target is operator.getitem and source.target in (getattr, "size") and source.args:
        source = source.args[0]
    elif size.target != "size":
        return False
    op = ops.get(source.name) if isinstance(source, torch.fx.Node) else None
    return op is not None and op.attrs.tp_dim is not None


def _local_split(node: torch.fx.Node, dim: int, tp: int, rank: int | None) -> None:
    """split: the split size (or each of the sizes) divided by `tp` where it splits along `dim`."""
    if _dim_arg(node, 2, rank) != dim:
        return
    sizes = node.args[1] if len(node.args) > 1 else node.kwargs.get("split_size_or_sections")
    local: Any
    if isinstance(sizes, list | tuple):
        local = type(sizes)(_local_size(node, s, tp) for s in sizes)
    else:
        local = _local_size(node, sizes, tp)
    if len(node.args) > 1:
        node.args = (node.args[0], local, *node.args[2:])
    else:
        node.kwargs = {**node.kwargs, "split_size_or_sections": local}


def _local_size(node: torch.fx.Node, size: Any, tp: int) -> Any:
    """One member's extent of a whole size: a constant divided, -1 kept, a computed size divided by a new node."""
    if isinstance(size, int):
        if size == -1:
            return size
        if size % tp:
            raise DappleError(f"%{node.name}: size {size} of the split dimension does not divide by tp = {tp}")
        return size // tp
    if isinstance(size, torch.fx.Node):
        with node.graph.inserting_before(node):
            return node.graph.call_function(operator.floordiv, (size, tp))
    raise DappleError(f"%{node.name}: cannot split a size given as {type(size).__name__} over a tensor group")


def shard_stage(sm: StageModule, module: Module, group: TensorGroup) -> None:
    """Make `sm` one member's shard of a tensor-parallel stage: its parameters sliced, its graph rewritten."""
    stage = module.stage(sm.name)
    if stage.tp != group.size:
        raise DappleError(f"@{sm.name} has tp = {stage.tp} but its tensor group has {group.size} ranks")
    sm.params = slice_params(sm.graph_module, sm.params, module, group)
    shard_graph(sm.graph_module, {op.name: op for op in stage.ops}, group)
    sm.tensor_group = group
