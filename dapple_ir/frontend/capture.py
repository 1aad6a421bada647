"""Capture: a trainable PyTorch model (model + loss) into the IR, without running it.

The model and its loss function are wrapped into one module whose forward takes every model input
and loss target positionally and returns the scalar loss, so that the loss is part of the graph
and the IR's `output` op is the loss. That wrapper is traced by one of two methods:

- `fx`: `torch.fx` symbolic tracing, module level. `torch.nn` built-in modules are leaves (one
  `call_module` op each) unless `leaf_modules` says otherwise; names stay readable.
- `export`: `torch.export.export(..., strict=False)`, ATen level. It runs the Python code, so it
  follows control flow that depends on shapes (which fx cannot), and lifts parameters to inputs;
  here they are turned back into `get_attr` reads so both methods give the same IR shape.

`auto` tries fx and falls back to export, logging why. Result types come from running the graph
on fake tensors (no real memory, so a model built on the meta device works at any size).

The returned `Captured.graph_module` is executable and is the contract with the torch backend: it
takes the IR's `input` ops positionally, in order, returns the scalar loss, and its node names are
the IR op names, so a runtime can cut it into stages by op name with `torch.fx`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import keyword
import logging
import os
import re
import sys
import traceback
import types
import warnings
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from dapple_ir.errors import CaptureError
from dapple_ir.ir import (
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

log = logging.getLogger("dapple_ir.frontend.capture")

#: Which modules fx keeps as single ops: a predicate `(module, path) -> bool`, or extra module types
#: on top of the default (`torch.nn` built-ins), or None for the default alone.
LeafPolicy = Callable[[Any, str], bool] | Collection[type] | None

METHODS = ("fx", "export")

_DTYPES = {
    "float64": "f64",
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
    "bool": "bool",
    "complex64": "c64",
}

#: Ops whose result aliases their first operand: an in-place op on such a result writes the input.
_VIEW_OPS = frozenset(
    {
        "view", "reshape", "getitem", "__getitem__", "transpose", "permute", "t", "squeeze", "unsqueeze",
        "expand", "narrow", "select", "slice", "flatten", "unflatten", "as_strided", "alias", "split", "chunk",
        "unbind", "view_as", "detach", "contiguous",
    }
)  # fmt: skip

_MODEL = "model"
_LOSS = "loss_fn"


@dataclass
class Captured:
    """A captured model: its IR and the executable graph it was made from."""

    module: Module
    """The IR; its `output` op is the scalar loss."""
    graph_module: Any
    """`torch.fx.GraphModule`: `graph_module(*inputs)` returns the loss; node names equal op names."""
    method: str
    """`fx` or `export`."""
    input_names: tuple[str, ...]
    """Names of the graph's placeholders (the IR's `input` ops), in order: model inputs, then targets."""
    target_names: tuple[str, ...]
    """The trailing inputs that are loss targets, which the last stage loads rather than the first."""
    example_inputs: tuple[Any, ...]
    """The example values, in `input_names` order (on the model's device)."""
    wrapper: Any
    """The `torch.nn.Module` holding the model (as `model`) and a module loss function (as `loss_fn`)."""
    any_batch: bool = True
    """Whether the graph reads the batch size from its inputs, so it runs at any microbatch size (fx:
    as far as the model's own code does; export: where it could keep dimension 0 symbolic). When
    False, capture again with example inputs of the microbatch size to run it."""
    notes: list[str] = field(default_factory=list)
    """What happened on the way (a method that failed before another worked, ops left without costs)."""


def capture(
    model: Any,
    example_inputs: Any = (),
    *,
    example_kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[..., Any] | None = None,
    example_targets: Any = (),
    method: str = "auto",
    leaf_modules: LeafPolicy = None,
    source: str | None = None,
    annotate_costs: bool = True,
) -> Captured:
    """Capture `model` (with `loss_fn(output, *targets)` when given) into the IR.

    `example_inputs` is a tuple of tensors (a dict is taken as keyword arguments); a model without a
    loss function must return a scalar loss or a dict with a `"loss"` entry. `annotate_costs` records
    per-op FLOPs and activation bytes (`dapple_ir.frontend.flops`); a runtime that only executes can skip it.
    """
    import torch

    if method not in (*METHODS, "auto"):
        raise CaptureError(f"capture method must be fx, export or auto, not {method!r}")
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"capture needs a torch.nn.Module, not a {type(model).__name__}")
    args, kwargs, targets = _normalise(example_inputs, example_kwargs, example_targets)
    if targets and loss_fn is None:
        raise CaptureError("example targets were given but no loss_fn to use them")
    names = _input_names(model, len(args), list(kwargs), len(targets))
    flat = _on_model_device(model, (*args, *kwargs.values(), *targets))
    batch = _batch_of(names, flat)
    wrapper = _make_wrapper(model, loss_fn, len(args), tuple(kwargs), names)
    gm, used, notes = _trace_some_way(wrapper, flat, method, leaf_modules)
    module = _build_module(gm, wrapper, used, batch, source or type(model).__name__)
    n_targets = len(targets)
    # fx renames a placeholder that shadows a builtin (`input` -> `input_1`): the graph has the last word.
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    captured = Captured(
        module=module,
        graph_module=gm,
        method=used,
        input_names=tuple(names),
        target_names=tuple(names[len(names) - n_targets :]) if n_targets else (),
        example_inputs=flat,
        wrapper=wrapper,
        any_batch=all(n.meta.get("symbolic_batch", True) for n in gm.graph.nodes if n.op == "placeholder"),
        notes=notes,
    )
    if not annotate_costs:
        return captured
    from dapple_ir.frontend.flops import annotate_flops

    skipped = annotate_flops(captured)
    if skipped:
        notes.append(f"no costs for {len(skipped)} op(s) that do not run on meta tensors: {', '.join(skipped[:5])}")
    return captured


# --------------------------------------------------------------------------- inputs and wrapper


def _normalise(inputs: Any, kwargs: dict[str, Any] | None, targets: Any) -> tuple[tuple, dict[str, Any], tuple]:
    import torch

    if isinstance(inputs, dict):
        if kwargs:
            raise CaptureError("give keyword inputs either as a dict example_inputs or as example_kwargs, not both")
        inputs, kwargs = (), inputs
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if isinstance(targets, torch.Tensor):
        targets = (targets,)
    if not isinstance(inputs, tuple | list) or not isinstance(targets, tuple | list):
        raise CaptureError("example_inputs and example_targets must be tuples of tensors")
    return tuple(inputs), dict(kwargs or {}), tuple(targets)


def _input_names(model: Any, n_args: int, kw_names: list[str], n_targets: int) -> list[str]:
    """Placeholder names: the forward's own parameter names, then the keywords, then `target`."""
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values() if p.kind <= p.POSITIONAL_OR_KEYWORD]
    except (TypeError, ValueError):
        params = []
    positional = [params[i].name if i < len(params) else f"input_{i}" for i in range(n_args)]
    target_names = ["target"] if n_targets == 1 else [f"target_{i}" for i in range(n_targets)]
    names: list[str] = []
    for raw in [*positional, *kw_names, *target_names]:
        name = re.sub(r"\W", "_", raw)
        if not name or name[0].isdigit() or keyword.iskeyword(name) or name == "self":
            name = "in_" + name
        while name in names:
            name += "_"
        names.append(name)
    return names


def _on_model_device(model: Any, values: tuple) -> tuple:
    """Example tensors moved to the meta device when the model lives there (factories may mix)."""
    import torch

    for i, value in enumerate(values):
        if not isinstance(value, torch.Tensor):
            raise CaptureError(
                f"example input {i} is a {type(value).__name__}; every input and target must be a tensor "
                "(pass constants through the model's constructor or as default arguments)"
            )
    on_meta = any(p.is_meta for p in model.parameters())
    return tuple(v.to("meta") if on_meta else v for v in values)


def _batch_of(names: list[str], values: tuple) -> int:
    if not values:
        raise CaptureError("the model has no example inputs; the batch is split along dimension 0 of the inputs")
    sizes = {}
    for name, value in zip(names, values, strict=True):
        if value.dim() == 0:
            raise CaptureError(f"input {name!r} is a scalar tensor; inputs and targets are split along dimension 0")
        sizes[name] = int(value.shape[0])
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{n}: {s}" for n, s in sizes.items())
        raise CaptureError(
            f"inputs disagree on the batch size (dimension 0): {listed}; every input and target is split into "
            "microbatches along dimension 0, so they need the same size there"
        )
    return next(iter(sizes.values()))


def _make_wrapper(model: Any, loss_fn: Any, n_args: int, kw_names: tuple[str, ...], names: list[str]) -> Any:
    """A module with `model` (and a module `loss_fn`) as children and forward(*names) -> loss."""
    import torch

    class Trainable(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            if isinstance(loss_fn, torch.nn.Module):
                self.loss_fn = loss_fn
            else:
                self.loss_function = loss_fn

        def loss_of(self, values: tuple) -> Any:
            args = values[:n_args]
            kwargs = dict(zip(kw_names, values[n_args : n_args + len(kw_names)], strict=True))
            out = self.model(*args, **kwargs)
            compute = self.loss_fn if isinstance(loss_fn, torch.nn.Module) else self.loss_function
            if compute is not None:
                return compute(out, *values[n_args + len(kw_names) :])
            if isinstance(out, dict):
                if "loss" not in out:
                    raise CaptureError(
                        f"the model returns a dict without a 'loss' entry (keys: {', '.join(map(str, out))}); "
                        "return the loss under 'loss' or give a loss_fn"
                    )
                return out["loss"]
            return out

    # The forward's signature names every input, so traced placeholders (and IR inputs) carry them.
    joined = ", ".join(names)
    namespace: dict[str, Any] = {}
    exec(f"def forward(self, {joined}):\n    return self.loss_of(({joined},))\n", namespace)
    Trainable.forward = namespace["forward"]  # type: ignore[method-assign]
    return Trainable()


# ------------------------------------------------------------------------------------ tracing


class _MethodFailed(Exception):
    """One capture method failed; `auto` may try the other."""

    def __init__(self, method: str, exc: BaseException, module_path: str | None, where: str | None = None) -> None:
        super().__init__(method)
        self.method = method
        self.exc = exc
        self.module_path = module_path
        self.where = where or _user_frame(exc)

    def describe(self) -> str:
        first = str(self.exc).strip().splitlines()
        text = first[0].rstrip(".") if first else ""
        if len(text) > 240:
            text = text[:240] + "..."
        place = []
        if self.module_path is not None:
            place.append(f"in module `{self.module_path or '(model)'}`")
        if self.where:
            place.append(f"at {self.where}")
        where = " " + " ".join(place) if place else ""
        return f"{self.method} failed{where}: {type(self.exc).__name__}: {text}"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Torch logs failures (with tracebacks and whole graphs) and prints some; the error we raise says it better."""
    disabled = logging.root.manager.disable
    logging.disable(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(disabled)


def _trace_some_way(wrapper: Any, flat: tuple, method: str, leaf: LeafPolicy) -> tuple[Any, str, list[str]]:
    order = METHODS if method == "auto" else (method,)
    failures: list[_MethodFailed] = []
    notes: list[str] = []
    for name in order:
        try:
            gm = _trace_fx(wrapper, flat, leaf) if name == "fx" else _trace_export(wrapper, flat)
        except _MethodFailed as failure:
            failures.append(failure)
            continue
        if failures:
            notes.append(f"captured with {name}; {'; '.join(f.describe() for f in failures)}")
            log.info(notes[-1])
        return gm, name, notes
    raise _combined_error(wrapper.model, failures)


def _combined_error(model: Any, failures: list[_MethodFailed]) -> CaptureError:
    first = failures[0]
    culprit = f"module `{first.module_path}`" if first.module_path else "the model's own forward"
    if first.where:
        culprit += f" at {first.where}"
    methods = " and ".join(f.method for f in failures)
    tried = " ".join(f"({i + 1}) {f.describe()}." for i, f in enumerate(failures))
    text = f"cannot capture {type(model).__name__} with {methods}: the first failure is in {culprit}. {tried}"
    if [f.method for f in failures] == ["fx"]:
        text += (
            " Try method export (or auto): it runs the Python code, so it follows branches and loops on "
            "shapes that fx cannot."
        )
    if any(_data_dependent(f.exc) for f in failures if f.method == "export"):
        text += (
            " The model branches or loops on tensor values (data-dependent control flow), which no static "
            "graph can hold: use torch.where, or move the decision out of forward."
        )
    return CaptureError(text)


def _data_dependent(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return "data-dependent" in text or "datadependent" in text or "data dependent" in text


class _FxTracer:
    """Builds the `torch.fx.Tracer` subclass lazily so this module imports without torch."""

    @staticmethod
    def make(leaf: LeafPolicy) -> Any:
        import torch.fx

        class Tracer(torch.fx.Tracer):
            def create_node(self, *args: Any, **kwargs: Any) -> torch.fx.Node:
                node = super().create_node(*args, **kwargs)
                # Walking frames is far cheaper than fx's own stack-trace recording.
                frame: types.FrameType | None = sys._getframe(1)
                while frame is not None and not _is_user_file(frame.f_code.co_filename):
                    frame = frame.f_back
                if frame is not None:
                    node.meta["loc"] = f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"
                return node

            def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
                if qualname == _LOSS:
                    return True
                path = _model_path(qualname) or ""
                if callable(leaf):
                    return bool(leaf(m, path))
                if leaf and isinstance(m, tuple(leaf)):
                    return True
                return bool(super().is_leaf_module(m, qualname))

        return Tracer()


def _trace_fx(wrapper: Any, flat: tuple, leaf: LeafPolicy) -> Any:
    import torch.fx

    tracer = _FxTracer.make(leaf)
    try:
        graph = tracer.trace(wrapper)
    except CaptureError:
        raise
    except Exception as exc:
        stack = list(tracer.module_stack.values())
        path = _model_path(stack[-1][0]) if stack else None
        raise _MethodFailed("fx", exc, path) from exc
    root: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op in ("get_attr", "call_module"):
            value = _fetch(wrapper, node.target)
            node.target = _strip_model(node.target)
            root[node.target] = value
        if node.name.startswith(_MODEL + "_"):
            node._rename(node.name[len(_MODEL) + 1 :])
    gm = _dead_code_free(torch.fx.GraphModule(root, graph, class_name=type(wrapper.model).__name__))
    _propagate(gm, flat)
    return gm


def _trace_export(wrapper: Any, flat: tuple) -> Any:
    import torch

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
        with _quiet():
            ep = torch.export.export(wrapper, flat, dynamic_shapes=dynamic, strict=False)
    except CaptureError:
        raise
    except Exception as exc:
        raise _MethodFailed("export", exc, _model_path(stack[-1]) if stack else None) from exc
    finally:
        for hook in hooks:
            hook.remove()
    return _graph_module_from_export(ep, wrapper)


def _graph_module_from_export(ep: Any, wrapper: Any) -> Any:
    """The exported graph with lifted parameters turned back into `get_attr` reads."""
    import torch
    import torch.fx
    from torch.export.graph_signature import InputKind, OutputKind

    graph = ep.graph_module.graph
    nodes = {n.name: n for n in graph.nodes}
    root: dict[str, Any] = {}
    for spec in ep.graph_signature.input_specs:
        node = nodes[spec.arg.name]
        if spec.kind is InputKind.USER_INPUT:
            continue
        value = ep.constants[spec.target] if spec.kind is InputKind.CONSTANT_TENSOR else _fetch(wrapper, spec.target)
        target = _strip_model(spec.target)
        root[target] = value
        _lower_placeholder(graph, node, target)
    output = next(n for n in graph.nodes if n.op == "output")
    values = list(output.args[0])
    loss = None
    for spec, value in zip(ep.graph_signature.output_specs, values, strict=True):
        if spec.kind is OutputKind.USER_INPUT_MUTATION:
            raise _input_mutation_error(spec.target, None)
        if spec.kind is OutputKind.BUFFER_MUTATION:
            target = _strip_model(spec.target)
            with graph.inserting_before(output), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                buffer = graph.get_attr(target)
                buffer.meta = dict(value.meta)
                graph.call_function(torch.ops.aten.copy_.default, (buffer, value))
        elif spec.kind is OutputKind.USER_OUTPUT:
            loss = value
    output.args = (loss,)
    graph._codegen = torch.fx.graph.CodeGen()
    _concretise(graph)
    return _dead_code_free(torch.fx.GraphModule(root, graph, class_name=type(wrapper.model).__name__))


def _concretise(graph: Any) -> None:
    """Swap export's symbolic example values for meta tensors of the example sizes.

    A backed size (the batch) takes its example value; an unbacked one (a size that depends on
    tensor values, as after `nonzero`) cannot be pipelined and is an error.
    """
    import torch
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    from torch.utils._pytree import tree_map

    def hint_int(value: Any) -> int:
        if isinstance(value, int):
            return value
        try:
            from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw
        except ImportError:  # older torch: int() reads the hint (and adds a guard nobody checks)
            return int(value)
        return int(guarding_hint_or_throw(value))

    def concrete(value: Any) -> Any:
        if isinstance(value, torch.SymInt):
            return hint_int(value)
        if not isinstance(value, torch.Tensor):
            return value
        shape = tuple(hint_int(d) for d in value.shape)
        stride = tuple(hint_int(d) for d in value.stride())
        return torch.empty_strided(shape, stride, dtype=value.dtype, device="meta")

    for node in graph.nodes:
        val = node.meta.get("val")
        if val is None:
            continue
        if free_unbacked_symbols(val):
            raise _dynamic_shape_error(node, f"sizes {sorted(map(str, free_unbacked_symbols(val)))} depend on values")
        if node.op == "placeholder":
            node.meta["symbolic_batch"] = isinstance(val, torch.Tensor) and not isinstance(val.shape[0], int)
        node.meta["val"] = tree_map(concrete, val)


def _dead_code_free(gm: Any) -> Any:
    # Values the loss does not need (the logits of a dict output, say) would be stage work for nothing.
    # In-place ops stay: their effect is on their operand, not on their (often unused) result.
    _check_no_input_mutation(gm)
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or _is_in_place(gm, n))
    gm.recompile()
    return gm


def _lower_placeholder(graph: Any, node: Any, target: str) -> None:
    """One `get_attr` per reader, next to it (as fx does), so stages take their reads with them."""
    for user in list(node.users):
        with graph.inserting_before(user), warnings.catch_warnings():
            # The exported module does not hold the attribute; the GraphModule built next will.
            warnings.simplefilter("ignore")
            read = graph.get_attr(target)
        read.meta = {"val": node.meta.get("val"), **{k: v for k, v in user.meta.items() if k == "nn_module_stack"}}
        if user.stack_trace:
            read.stack_trace = user.stack_trace
        user.replace_input_with(node, read)
    graph.erase_node(node)


#: ATen ops whose result shape depends on tensor values (boolean masks index through nonzero).
_DATA_DEPENDENT_OPS = ("nonzero", "masked_select", "unique", "repeat_interleave", "bincount", "histc")


def _propagate(gm: Any, flat: tuple) -> None:
    """Run `gm` on meta tensors, storing each node's result as `node.meta["val"]`.

    Meta tensors carry shapes and dtypes only, so a model of any size propagates in little memory
    and time. A node without a meta kernel is retried on fake tensors, which know more ops.
    """
    import torch.fx
    from torch.func import functional_call

    metas: dict[int, Any] = {}

    def meta(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.is_meta:
            return t
        if id(t) not in metas:
            metas[id(t)] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return metas[id(t)]

    class Propagate(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            try:
                result = super().run_node(n)
            except CaptureError:
                raise
            except Exception as exc:
                culprit = next((op for op in _DATA_DEPENDENT_OPS if op in str(exc)), None)
                if culprit:
                    raise _dynamic_shape_error(n, f"torch.{culprit} has an output size that depends on values") from exc
                result = _run_node_fake(self, n, exc)
            n.meta["val"] = result
            return result

        def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
            return meta(super().get_attr(target, args, kwargs))

        def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
            sub = self.fetch_attr(target)
            # The module's own tensors are swapped for meta ones: its in-place buffer updates land there.
            state = {k: meta(v) for k, v in [*sub.named_parameters(), *sub.named_buffers()]}
            return functional_call(sub, state, tuple(args), kwargs)

    interpreter = Propagate(gm)
    interpreter.extra_traceback = False  # our errors name the op themselves
    with _quiet():
        interpreter.run(*[meta(v) for v in flat])


def _run_node_fake(interp: Any, n: Any, meta_failure: Exception) -> Any:
    """One node on fake tensors (the fallback for ops without a meta kernel); returns meta results."""
    import torch
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
    from torch.utils._pytree import tree_map

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def to_fake(t: Any) -> Any:
        return mode.from_tensor(t) if isinstance(t, torch.Tensor) else t

    def to_meta(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    saved = interp.env
    interp.env = {k: tree_map(to_fake, v) for k, v in saved.items()}
    try:
        with mode:
            result = torch.fx.Interpreter.run_node(interp, n)
    except DynamicOutputShapeException as exc:
        raise _dynamic_shape_error(n, f"{exc} has an output size that depends on values") from exc
    except Exception as exc:
        loc = _location(n)
        raise _MethodFailed(
            "fx", meta_failure, _op_path(n), f"{loc} (op %{n.name})" if loc else f"op %{n.name}"
        ) from exc
    finally:
        interp.env = saved
    return tree_map(to_meta, result)


# ------------------------------------------------------------------------------------ checks


def _check_no_input_mutation(gm: Any) -> None:
    for node in gm.graph.nodes:
        if not _is_in_place(gm, node) or not node.args:
            continue
        base = _alias_base(node.args[0])
        if base is not None and base.op == "placeholder":
            raise _input_mutation_error(base.name, node)


def _is_in_place(gm: Any, node: Any) -> bool:
    import operator

    name = _callee_name(node)
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
    import torch.fx

    while isinstance(value, torch.fx.Node) and value.op != "placeholder":
        if _callee_name(value) not in _VIEW_OPS or not value.args:
            return None
        value = value.args[0]
    return value if isinstance(value, torch.fx.Node) else None


def _callee_name(node: Any) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return ""
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return str(schema.name).split("::")[-1]
    return getattr(node.target, "__name__", str(node.target))


def _input_mutation_error(input_name: str, node: Any) -> CaptureError:
    where = ""
    if node is not None:
        loc = _location(node)
        where = f" by `{_callee_name(node) or node.target}` (op %{node.name}{', ' + loc if loc else ''})"
    return CaptureError(
        f"the model modifies its input {input_name!r} in place{where}; a pipeline reuses inputs across stages "
        "and microbatches, so write it out of place (x = x + 1 rather than x += 1 or x.add_(1))"
    )


def _dynamic_shape_error(node: Any, detail: str) -> CaptureError:
    loc = _location(node)
    return CaptureError(
        f"op %{node.name} (`{_callee_name(node) or node.target}`{', ' + loc if loc else ''}) has a result whose "
        f"shape depends on tensor values (dynamic shape: {detail}); "
        "pipeline stages exchange tensors of static shape, so replace it (e.g. masking instead of boolean indexing)"
    )


# ------------------------------------------------------------------------------------- the IR


def _build_module(gm: Any, wrapper: Any, method: str, batch: int, source: str) -> Module:
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
                readers.setdefault(name, set()).add(_scope(node)[1])
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
    attrs = OpAttrs(module_path=_scope(node)[0], loc=_location(node))
    tuple_type = op.operands[0].type if op.operands else None
    if _callee_name(node) == "getitem" and isinstance(node.args[1], int) and isinstance(tuple_type, TupleType):
        # x.shape[-1] counts from the end; the IR counts from the start.
        attrs.index = node.args[1] % len(tuple_type.elements) if tuple_type.elements else None
    return attrs


def _param(name: str, tensor: Any, shared: bool) -> Param:
    import torch

    param_type = _tensor_type(tensor, f"parameter {name}")
    if not isinstance(param_type, TensorType):
        raise CaptureError(f"parameter {name} has dtype {tensor.dtype}, which the IR does not know")
    trainable = isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad
    return Param(name, param_type, ParamAttrs(buffer=None if trainable else True, shared=True if shared else None))


_KIND = {
    "placeholder": OpKind.INPUT,
    "get_attr": OpKind.GET_ATTR,
    "call_module": OpKind.CALL_MODULE,
    "call_function": OpKind.CALL_FUNCTION,
    "call_method": OpKind.CALL_METHOD,
    "output": OpKind.OUTPUT,
}


def _canonical_names(wrapper: Any) -> dict[int, str]:
    """The first name of every parameter and buffer (a tied tensor keeps its first name)."""
    names: dict[int, str] = {}
    for name, tensor in [*wrapper.named_parameters(), *wrapper.named_buffers()]:
        names.setdefault(id(tensor), _strip_model(name))
    return names


def _reads(gm: Any, node: Any, canonical: dict[int, str]) -> dict[str, Any]:
    """Parameters and buffers (by canonical name) that a node reads directly."""
    if node.op == "get_attr":
        tensor = _fetch(gm, node.target)
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
    if isinstance(value, TensorType) and value.shape == () and value.dtype in ("f64", "f32", "f16", "bf16"):
        return
    from dapple_ir.ir.printer import format_type

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
    import torch

    if isinstance(value, torch.Tensor):
        return _tensor_type(value, f"op %{node.name}", node)
    if isinstance(value, tuple | list):
        return TupleType(tuple(_value_type(v, node) for v in value))
    return OpaqueType()


def _tensor_type(tensor: Any, what: str, node: Any = None) -> Type:
    dtype = _DTYPES.get(str(tensor.dtype).removeprefix("torch."))
    if dtype is None:
        return OpaqueType()
    shape = []
    for dim in tensor.shape:
        try:
            shape.append(int(dim))
        except Exception as exc:  # an unbacked symbolic size: the shape depends on data
            if node is not None:
                raise _dynamic_shape_error(node, f"dimension {dim}") from exc
            raise CaptureError(f"{what} has a symbolic dimension {dim}") from exc
    return TensorType(dtype, tuple(shape))


def _target_text(node: Any) -> str:
    if node.op in ("call_module", "call_method", "get_attr"):
        return str(node.target)
    if hasattr(node.target, "_schema"):
        return str(node.target)  # aten.linear.default
    from torch.fx.node import _get_qualified_name

    try:
        name = str(_get_qualified_name(node.target))
    except Exception:
        return getattr(node.target, "__name__", str(node.target))
    # `operator.getitem` is what people write (and what the verifier checks), `_operator` its C module.
    return "operator." + name.removeprefix("_operator.") if name.startswith("_operator.") else name


def _scope(node: Any) -> tuple[str | None, str]:
    """(module path within the model, key of the module call) of the op.

    Ops outside the model are the loss computation (`loss_fn`); ops in the model's own forward
    have no path. The call key tells two calls of one module apart (a block applied twice).
    """
    if node.op == "call_module" and node.target == _LOSS:
        return _LOSS, _LOSS
    stack = node.meta.get("nn_module_stack") or {}
    calls = [(key, value[0]) for key, value in stack.items() if value[0]]
    if not calls:
        return _LOSS, _LOSS
    key, path = calls[-1]
    if path == _LOSS or path.startswith(_LOSS + "."):
        return path, str(key)
    return _model_path(path), str(key)


def _op_path(node: Any) -> str | None:
    return _scope(node)[0]


def _strip_model(dotted: str) -> str:
    """A wrapper-level attribute name as the user knows it: `model.tok.weight` -> `tok.weight`."""
    return dotted.removeprefix(_MODEL + ".")


def _model_path(qualname: str) -> str | None:
    """A wrapper-level module name as the user knows it: `model.blocks.0` -> `blocks.0`."""
    if qualname == _MODEL:
        return None
    return qualname.removeprefix(_MODEL + ".")


def _fetch(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------- source locations

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


@functools.cache
def _torch_dir() -> str:
    import torch

    return os.path.dirname(torch.__file__)


def _is_user_file(filename: str) -> bool:
    return not (filename.startswith(_torch_dir()) or filename == __file__ or filename.startswith("<"))


@functools.cache
def _short(filename: str) -> str:
    rel = os.path.relpath(filename)
    return filename if rel.startswith("..") else rel


def _location(node: Any) -> str | None:
    """`file:line` of the innermost user frame (not torch) in the node's stack trace."""
    if "loc" in node.meta:
        return str(node.meta["loc"])
    trace = node.stack_trace or node.meta.get("stack_trace") or ""
    frames = [(f, int(line)) for f, line in _FRAME.findall(trace) if _is_user_file(f)]
    if not frames:
        return None
    filename, line = frames[-1]
    return f"{_short(filename)}:{line}"


def _user_frame(exc: BaseException) -> str | None:
    """`file:line \\`code\\`` of the innermost user frame where an exception passed."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_file(f.filename)]
    if not frames:
        return None
    frame = frames[-1]
    code = f" `{frame.line.strip()}`" if frame.line else ""
    return f"{_short(frame.filename)}:{frame.lineno}{code}"
