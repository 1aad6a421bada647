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

This module builds the wrapper; the steps after it live beside it: `tracing` (fx and export),
`sizes` (each op reads the sizes it needs from the inputs itself, so no size value blocks a cut),
`propagation` (example values on meta tensors), `graph_checks` (inputs written in place, dynamic
shapes), `to_ir` (the IR module), `source_locations` (the user's line of each op) and `flops` (costs).
`runnable` gives a graph captured on the meta device the real model's tensors, for training.
"""

from __future__ import annotations

import inspect
import keyword
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dapple_ir.errors import CaptureError
from dapple_ir.frontend.flops import annotate_flops
from dapple_ir.frontend.to_ir import build_module
from dapple_ir.frontend.tracing import METHODS, LeafPolicy, trace_some_way
from dapple_ir.ir import Module

__all__ = ["METHODS", "Captured", "LeafPolicy", "capture"]


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
    trace_device: str | None = None,
) -> Captured:
    """Capture `model` (with `loss_fn(output, *targets)` when given) into the IR.

    `example_inputs` is a tuple of tensors (a dict is taken as keyword arguments); a model without a
    loss function must return a scalar loss or a dict with a `"loss"` entry. `annotate_costs` records
    per-op FLOPs and activation bytes (`dapple_ir.frontend.flops`); a runtime that only executes can skip it.
    `trace_device` (`cpu`, `cuda`) is the device type the model's code sees its tensors on while export traces
    it, so that code which picks its kernels by device picks those of the device it will train on
    (`dapple_ir.frontend.trace_device`); None: the device the tensors are on (meta for a model built there).
    """
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
    gm, used, notes = trace_some_way(wrapper, flat, method, leaf_modules, trace_device)
    module = build_module(gm, wrapper, used, batch, source or type(model).__name__)
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
    skipped = annotate_flops(captured)
    if skipped:
        notes.append(f"no costs for {len(skipped)} op(s) that do not run on meta tensors: {', '.join(skipped[:5])}")
    return captured


# --------------------------------------------------------------------------- inputs and wrapper


def _normalise(inputs: Any, kwargs: dict[str, Any] | None, targets: Any) -> tuple[tuple, dict[str, Any], tuple]:
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
    # The same tensor given as two inputs ({"input_ids": ids, "labels": ids}, as Hugging Face examples
    # do) would become one graph input, and training would feed one input's data to both: each
    # input gets a tensor of its own.
    seen: set[int] = set()

    def own(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) in seen:
            return value.clone()
        seen.add(id(value))
        return value

    args = tuple(own(v) for v in inputs)
    keywords = {k: own(v) for k, v in (kwargs or {}).items()}
    return args, keywords, tuple(own(v) for v in targets)


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
