"""A traced graph to the IR: one op per node, parameters by the name the user knows them by, result
types from the nodes' example values, and the module paths and source lines as op attributes."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.node import _get_qualified_name

from dapple_ir.errors import CaptureError
from dapple_ir.frontend.dtypes import IR_DTYPE_OF
from dapple_ir.frontend.graph_checks import callee_name, dynamic_shape_error
from dapple_ir.frontend.module_paths import fetch, scope, strip_model
from dapple_ir.frontend.source_locations import location
from dapple_ir.ir import (
    FLOAT_DTYPES,
    NORMALISING_CALLEES,
    Module,
    ModuleAttrs,
    Op,
    OpaqueType,
    OpAttrs,
    OpKind,
    Param,
    ParamAttrs,
    TensorType,
    TupleType,
    Type,
)
from dapple_ir.ir.printer import format_type

_KIND = {
    "placeholder": OpKind.INPUT,
    "get_attr": OpKind.GET_ATTR,
    "call_module": OpKind.CALL_MODULE,
    "call_function": OpKind.CALL_FUNCTION,
    "call_method": OpKind.CALL_METHOD,
    "output": OpKind.OUTPUT,
}
#: Backward starts from a real scalar: a complex loss has no gradient of its own.
_LOSS_DTYPES = FLOAT_DTYPES - {"c64"}


def build_module(gm: Any, wrapper: Any, method: str, batch: int, source: str) -> Module:
    """The IR of graph module `gm`, traced from `wrapper` by `method`, at `batch` samples."""
    canonical = _canonical_names(wrapper)
    module = Module(
        name=type(wrapper.model).__name__,
        attrs=ModuleAttrs(batch=batch, source=source, capture_method=method),
    )
    ops: dict[Any, Op] = {}
    readers: dict[str, set[str]] = {}  # parameter -> the module calls that read it
    tensors: dict[str, Any] = {}
    placeholders = 0
    for node in gm.graph.nodes:
        op = Op(node.name, _KIND[node.op], [ops[a] for a in node.all_input_nodes], _type_of(node))
        op.attrs = _op_attrs(node, op, placeholders)
        placeholders += node.op == "placeholder"
        if node.op not in ("placeholder", "output"):
            op.target = _target_text(node)
            reads = _reads(gm, node, canonical)
            for name, tensor in reads.items():
                tensors.setdefault(name, tensor)
                readers.setdefault(name, set()).add(scope(node)[1])
            op.attrs.params = tuple(reads) or None
            if node.op == "get_attr":
                op.target = next(iter(reads))
        ops[node] = op
        module.ops.append(op)
    order = {name: i for i, name in enumerate(canonical.values())}
    for name in sorted(tensors, key=lambda n: order.get(n, len(order))):
        module.params.append(_param(name, tensors[name], shared=len(readers[name]) > 1))
    _check_output(module)
    return module


def _op_attrs(node: Any, op: Op, inputs_before: int) -> OpAttrs:
    if node.op == "placeholder":
        return OpAttrs(index=inputs_before)
    if node.op == "output":
        return OpAttrs()
    attrs = OpAttrs(module_path=scope(node)[0], loc=location(node))
    tuple_type = op.operands[0].type if op.operands else None
    if callee_name(node) == "getitem" and isinstance(node.args[1], int) and isinstance(tuple_type, TupleType):
        # x.shape[-1] counts from the end; the IR counts from the start.
        attrs.index = node.args[1] % len(tuple_type.elements) if tuple_type.elements else None
    attrs.dim = _normalised_dim(node, op)
    return attrs


def _normalised_dim(node: Any, op: Op) -> int | None:
    """The dimension a softmax-like op normalises along (its `dim` argument, else its first integer argument after
    the tensor), counted from the start."""
    if callee_name(node) not in NORMALISING_CALLEES or not isinstance(op.type, TensorType):
        return None
    dim = node.kwargs.get("dim", next((a for a in node.args[1:] if isinstance(a, int)), None))
    rank = len(op.type.shape)
    return dim % rank if isinstance(dim, int) and rank else None


def _param(name: str, tensor: Any, shared: bool) -> Param:
    param_type = _tensor_type(tensor, f"parameter {name}")
    if not isinstance(param_type, TensorType):
        raise CaptureError(f"parameter {name} has dtype {tensor.dtype}, which the IR does not know")
    trainable = isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad
    return Param(name, param_type, ParamAttrs(buffer=None if trainable else True, shared=True if shared else None))


def _canonical_names(wrapper: Any) -> dict[int, str]:
    """The first name of every parameter and buffer (a tied tensor keeps its first name)."""
    names: dict[int, str] = {}
    for name, tensor in [*wrapper.named_parameters(), *wrapper.named_buffers()]:
        names.setdefault(id(tensor), strip_model(name))
    return names


def _reads(gm: Any, node: Any, canonical: dict[int, str]) -> dict[str, Any]:
    """Parameters and buffers (by canonical name) that a node reads directly."""
    if node.op == "get_attr":
        tensor = fetch(gm, node.target)
        return {canonical.get(id(tensor), node.target): tensor}
    if node.op != "call_module":
        return {}
    sub = gm.get_submodule(node.target)
    found: dict[str, Any] = {}
    for local, tensor in [*sub.named_parameters(), *sub.named_buffers()]:
        found.setdefault(canonical.get(id(tensor), f"{node.target}.{local}"), tensor)
    return found


def _check_output(module: Module) -> None:
    out = module.ops[-1]
    value = out.operands[0].type if out.operands else OpaqueType()
    if isinstance(value, TensorType) and value.shape == () and value.dtype in _LOSS_DTYPES:
        return
    raise CaptureError(
        f"the captured graph returns {format_type(value)}, not a scalar floating-point loss; give a loss_fn "
        "(the factory's third item, called as loss_fn(output, *targets)), or return a scalar loss or a dict "
        "with a 'loss' entry from forward"
    )


def _type_of(node: Any) -> Type:
    if node.op == "output":
        return _type_of(node.args[0]) if node.args and hasattr(node.args[0], "meta") else OpaqueType()
    return _value_type(node.meta.get("val"), node)


def _value_type(value: Any, node: Any) -> Type:
    if isinstance(value, torch.Tensor):
        return _tensor_type(value, f"op %{node.name}", node)
    if isinstance(value, tuple | list):
        return TupleType(tuple(_value_type(v, node) for v in value))
    return OpaqueType()


def _tensor_type(tensor: Any, what: str, node: Any = None) -> Type:
    """The IR type of a tensor (opaque for a dtype the IR does not know); `what` names it in errors."""
    dtype = IR_DTYPE_OF.get(tensor.dtype)
    if dtype is None:
        return OpaqueType()
    shape = []
    for dim in tensor.shape:
        try:
            shape.append(int(dim))
        except Exception as exc:  # an unbacked symbolic size: the shape depends on data
            if node is not None:
                raise dynamic_shape_error(node, f"dimension {dim}") from exc
            raise CaptureError(f"{what} has a symbolic dimension {dim}") from exc
    return TensorType(dtype, tuple(shape))


def _target_text(node: Any) -> str:
    if node.op in ("call_module", "call_method", "get_attr"):
        return str(node.target)
    if hasattr(node.target, "_schema"):
        return str(node.target)  # aten.linear.default
    try:
        name = str(_get_qualified_name(node.target))
    except Exception:
        return getattr(node.target, "__name__", str(node.target))
    # `operator.getitem` is what people write (and what the verifier checks), `_operator` its C module.
    return "operator." + name.removeprefix("_operator.") if name.startswith("_operator.") else name
