"""What a pipeline cannot hold, found in a traced graph: inputs written in place, and results whose
shape depends on tensor values. Each error names the op, its callee and the user's line."""

from __future__ import annotations

import operator
from typing import Any

import torch.fx

from dapple_ir.errors import CaptureError
from dapple_ir.frontend.source_locations import location

#: Ops whose result aliases their first operand: an in-place op on such a result writes the input.
_VIEW_OPS = frozenset(
    {
        "view", "reshape", "getitem", "__getitem__", "transpose", "permute", "t", "squeeze", "unsqueeze",
        "expand", "narrow", "select", "slice", "flatten", "unflatten", "as_strided", "alias", "split", "chunk",
        "unbind", "view_as", "detach", "contiguous",
    }
)  # fmt: skip


def check_no_input_mutation(gm: Any) -> None:
    for node in gm.graph.nodes:
        if not is_in_place(gm, node) or not node.args:
            continue
        base = _alias_base(node.args[0])
        if base is not None and base.op == "placeholder":
            raise input_mutation_error(base.name, node)


def is_in_place(gm: Any, node: Any) -> bool:
    name = callee_name(node)
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(node.target), "inplace", False))
    if node.op == "call_function" and node.target is operator.setitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return bool(schema.is_mutable)
    return node.op in ("call_method", "call_function") and name.endswith("_") and not name.startswith("__")


def _alias_base(value: Any) -> Any:
    while isinstance(value, torch.fx.Node) and value.op != "placeholder":
        if callee_name(value) not in _VIEW_OPS or not value.args:
            return None
        value = value.args[0]
    return value if isinstance(value, torch.fx.Node) else None


def callee_name(node: Any) -> str:
    """The short name of what a node calls (`add_`, `linear`), empty for modules and attributes."""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return ""
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return str(schema.name).split("::")[-1]
    return getattr(node.target, "__name__", str(node.target))


def input_mutation_error(input_name: str, node: Any) -> CaptureError:
    where = ""
    if node is not None:
        loc = location(node)
        where = f" by `{callee_name(node) or node.target}` (op %{node.name}{', ' + loc if loc else ''})"
    return CaptureError(
        f"the model modifies its input {input_name!r} in place{where}; a pipeline reuses inputs across stages "
        "and microbatches, so write it out of place (x = x + 1 rather than x += 1 or x.add_(1))"
    )


def dynamic_shape_error(node: Any, detail: str) -> CaptureError:
    loc = location(node)
    return CaptureError(
        f"op %{node.name} (`{callee_name(node) or node.target}`{', ' + loc if loc else ''}) has a result whose "
        f"shape depends on tensor values (dynamic shape: {detail}); "
        "pipeline stages exchange tensors of static shape, so replace it (e.g. masking instead of boolean indexing)"
    )
