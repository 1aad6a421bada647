"""Tracing the capture wrapper into a `torch.fx.GraphModule`, by fx or by export.

Both methods give the same shape of graph: placeholders for the inputs, `get_attr` reads of
parameters next to their readers, the scalar loss as the output, no dead code, and each node's
example value (on the meta device) in `node.meta["val"]`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.fx
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.experimental import symbolic_shapes
from torch.utils._pytree import tree_map

from dapple_ir.errors import CaptureError
from dapple_ir.frontend.graph_checks import (
    check_no_input_mutation,
    dynamic_shape_error,
    input_mutation_error,
    is_in_place,
)
from dapple_ir.frontend.method_failure import MethodFailed, combined_error, quiet
from dapple_ir.frontend.module_paths import LOSS, MODEL, WRAPPER_PATH, fetch, model_path, strip_model
from dapple_ir.frontend.propagation import propagate
from dapple_ir.frontend.sizes import localise_sizes
from dapple_ir.frontend.source_locations import caller_location
from dapple_ir.frontend.trace_device import presenting, to_meta_literals

log = logging.getLogger("dapple_ir.frontend.capture")

#: Which modules fx keeps as single ops: a predicate `(module, path) -> bool`, or extra module types
#: on top of the default (`torch.nn` built-ins), or None for the default alone.
LeafPolicy = Callable[[Any, str], bool] | Collection[type] | None

METHODS = ("fx", "export")


def trace_some_way(
    wrapper: Any, flat: tuple, method: str, leaf: LeafPolicy, trace_device: str | None = None
) -> tuple[Any, str, list[str]]:
    """(graph module, the method that worked, notes): each method of `method` in turn (both for auto).

    `trace_device`: the device type the model's code sees its meta tensors on under export (see
    `trace_device`); fx never shows the model a tensor's device (its parameters are proxies)."""
    order = METHODS if method == "auto" else (method,)
    failures: list[MethodFailed] = []
    notes: list[str] = []
    for name in order:
        try:
            gm = _trace_fx(wrapper, flat, leaf) if name == "fx" else _trace_export(wrapper, flat, trace_device)
        except MethodFailed as failure:
            failures.append(failure)
            continue
        if failures:
            notes.append(f"captured with {name}; {'; '.join(f.describe() for f in failures)}")
            log.info(notes[-1])
        return gm, name, notes
    raise combined_error(wrapper.model, failures)


# ------------------------------------------------------------------------------------------ fx


class _Tracer(torch.fx.Tracer):
    """fx's tracer with the leaf policy and each node's user source line."""

    def __init__(self, leaf: LeafPolicy) -> None:
        super().__init__()
        self.leaf = leaf

    def create_node(self, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = super().create_node(*args, **kwargs)
        loc = caller_location()
        if loc is not None:
            node.meta["loc"] = loc
        return node

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        if qualname == LOSS:
            return True
        path = model_path(qualname) or ""
        if callable(self.leaf):
            return bool(self.leaf(m, path))
        if self.leaf and isinstance(m, tuple(self.leaf)):
            return True
        return bool(super().is_leaf_module(m, qualname))


def _trace_fx(wrapper: Any, flat: tuple, leaf: LeafPolicy) -> Any:
    tracer = _Tracer(leaf)
    try:
        graph = tracer.trace(wrapper)
    except CaptureError:
        raise
    except Exception as exc:
        stack = list(tracer.module_stack.values())
        path = model_path(stack[-1][0]) if stack else None
        raise MethodFailed("fx", exc, path) from exc
    root: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            value = fetch(wrapper, node.target)
            node.meta[WRAPPER_PATH] = node.target
            node.target = strip_model(node.target)
            root[node.target] = value
        if node.name.startswith(MODEL + "_"):
            node._rename(node.name[len(MODEL) + 1 :])
    gm = _dead_code_free(torch.fx.GraphModule(root, graph, class_name=type(wrapper.model).__name__))
    propagate(gm, flat)
    return gm


# -------------------------------------------------------------------------------------- export


def _trace_export(wrapper: Any, flat: tuple, trace_device: str | None) -> Any:
    stack: list[str] = []
    names = {id(m): name for name, m in wrapper.named_modules()}

    def push(m: Any, _args: Any) -> None:
        stack.append(names.get(id(m), "?"))

    def pop(m: Any, _args: Any, _out: Any) -> None:
        if stack:
            stack.pop()

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(push)]
    hooks.append(torch.nn.modules.module.register_module_forward_hook(pop))
    # Dimension 0 is left symbolic where the model allows, so the graph runs at any microbatch size.
    dynamic = tuple({0: torch.export.Dim.AUTO} for _ in flat)
    try:
        with quiet(), presenting(trace_device):
            ep = torch.export.export(wrapper, flat, dynamic_shapes=dynamic, strict=False)
    except CaptureError:
        raise
    except Exception as exc:
        raise MethodFailed("export", exc, model_path(stack[-1]) if stack else None) from exc
    finally:
        for hook in hooks:
            hook.remove()
    to_meta_literals(ep.graph_module.graph, trace_device)
    return _graph_module_from_export(ep, wrapper)


def _graph_module_from_export(ep: Any, wrapper: Any) -> Any:
    """The exported graph with lifted parameters turned back into `get_attr` reads."""
    graph = ep.graph_module.graph
    nodes = {n.name: n for n in graph.nodes}
    root: dict[str, Any] = {}
    for spec in ep.graph_signature.input_specs:
        node = nodes[spec.arg.name]
        if spec.kind is InputKind.USER_INPUT:
            continue
        constant = spec.kind is InputKind.CONSTANT_TENSOR
        value = ep.constants[spec.target] if constant else fetch(wrapper, spec.target)
        target = strip_model(spec.target)
        root[target] = value
        # A lifted constant is no attribute of the wrapper: it lives in the graph module alone.
        _lower_placeholder(graph, node, target, None if constant else spec.target)
    output = next(n for n in graph.nodes if n.op == "output")
    values = list(output.args[0])
    loss = None
    for spec, value in zip(ep.graph_signature.output_specs, values, strict=True):
        if spec.kind is OutputKind.USER_INPUT_MUTATION:
            raise input_mutation_error(spec.target, None)
        if spec.kind is OutputKind.BUFFER_MUTATION:
            target = strip_model(spec.target)
            with graph.inserting_before(output), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                buffer = graph.get_attr(target)
                buffer.meta = {**value.meta, WRAPPER_PATH: spec.target}
                graph.call_function(torch.ops.aten.copy_.default, (buffer, value))
        elif spec.kind is OutputKind.USER_OUTPUT:
            loss = value
    output.args = (loss,)
    graph._codegen = torch.fx.graph.CodeGen()
    _concretise(graph)
    return _dead_code_free(torch.fx.GraphModule(root, graph, class_name=type(wrapper.model).__name__))


def _hint_int(value: Any) -> int:
    if isinstance(value, int):
        return value
    hint = getattr(symbolic_shapes, "guarding_hint_or_throw", None)
    if hint is None:  # older torch: int() reads the hint (and adds a guard nobody checks)
        return int(value)
    return int(hint(value))


def _concrete(value: Any) -> Any:
    if isinstance(value, torch.SymInt):
        return _hint_int(value)
    if not isinstance(value, torch.Tensor):
        return value
    shape = tuple(_hint_int(d) for d in value.shape)
    stride = tuple(_hint_int(d) for d in value.stride())
    return torch.empty_strided(shape, stride, dtype=value.dtype, device="meta")


def _concretise(graph: Any) -> None:
    """Swap export's symbolic example values for meta tensors of the example sizes.

    A backed size (the batch) takes its example value; an unbacked one (a size that depends on
    tensor values, as after `nonzero`) cannot be pipelined and is an error.
    """
    for node in graph.nodes:
        val = node.meta.get("val")
        if val is None:
            continue
        unbacked = symbolic_shapes.free_unbacked_symbols(val)
        if unbacked:
            raise dynamic_shape_error(node, f"sizes {sorted(map(str, unbacked))} depend on values")
        if node.op == "placeholder":
            # A batch the model pins (x.reshape(4, 3)) is still a SymInt, but one without free symbols.
            symbolic = isinstance(val, torch.Tensor) and bool(symbolic_shapes.free_symbols(val.shape[0]))
            node.meta["symbolic_batch"] = symbolic
        node.meta["val"] = tree_map(_concrete, val)


def _lower_placeholder(graph: Any, node: Any, target: str, wrapper_path: str | None) -> None:
    """One `get_attr` per reader, next to it (as fx does), so stages take their reads with them."""
    for user in list(node.users):
        with graph.inserting_before(user), warnings.catch_warnings():
            # The exported module does not hold the attribute; the GraphModule built next will.
            warnings.simplefilter("ignore")
            read = graph.get_attr(target)
        read.meta = {"val": node.meta.get("val"), **{k: v for k, v in user.meta.items() if k == "nn_module_stack"}}
        if wrapper_path is not None:
            read.meta[WRAPPER_PATH] = wrapper_path
        if user.stack_trace:
            read.stack_trace = user.stack_trace
        user.replace_input_with(node, read)
    graph.erase_node(node)


def _dead_code_free(gm: Any) -> Any:
    # Values the loss does not need (the logits of a dict output, say) would be stage work for nothing.
    # In-place ops stay: their effect is on their operand, not on their (often unused) result.
    check_no_input_mutation(gm)
    # Before dead code goes: the size values each op reads become its own, so the originals die.
    localise_sizes(gm.graph)
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or is_in_place(gm, n))
    gm.recompile()
    return gm
