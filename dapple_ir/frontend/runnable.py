"""The graph that was planned, made to train: a capture on the meta device given a real model's tensors.

A plan is compiled from a capture on the meta device. Capturing again on the training device would
give a graph that can differ from it: torch traces what the device's kernels do, and they differ in
small ways (a `contiguous` that one device's attention output needs and another's does not, a
`lift_fresh_copy` that only real constants get). So the runtime captures exactly as compile did,
from the factory on the meta device, and only then swaps in the tensors of the model the factory
builds on the real device: parameters and buffers by their path in the model, constants that the
trace created by value, device literals (`arange(..., device=meta)`) retargeted. The graph that
trains is then the graph that was planned, op for op.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_map

from dapple_ir.errors import CaptureError
from dapple_ir.frontend.capture import Captured
from dapple_ir.frontend.module_paths import LOSS, MODEL, WRAPPER_PATH, fetch

_META = torch.device("meta")


def bind_model(captured: Captured, model: torch.nn.Module, loss_fn: Any = None) -> torch.fx.GraphModule:
    """`captured`'s graph reading the tensors and submodules of `model` (and a module `loss_fn`).

    `model` must be the model `captured` was made from, built again (on any device, with real
    weights): its parameters and buffers are read by path and checked for shape and dtype. Constants
    the trace created keep their captured values; an empty one made on the meta device is made anew,
    a non-empty one is an error, since the meta device never held its values. The graph module
    returned takes over `captured`'s graph.
    """
    gm = captured.graph_module
    owners = {MODEL: model, LOSS: loss_fn}
    root: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op not in ("get_attr", "call_module") or node.target in root:
            continue
        path = node.meta.get(WRAPPER_PATH)
        owner_name, _, rest = str(path).partition(".") if path else ("", "", "")
        if path and owner_name in owners:
            root[node.target] = _real(owners[owner_name], rest, node, gm)
        else:
            root[node.target] = _constant(fetch(gm, node.target), node)
    return torch.fx.GraphModule(root, gm.graph, class_name=type(gm).__name__)


def retarget_devices(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """Make the graph run on `device`, in place: its meta-device literals (`arange(..., device=meta)`)
    point at `device`, and its views tolerate the device's memory layouts.

    A kernel may lay its output out differently on the meta device than on a real one (attention
    does), and the trace records a `contiguous` only where the meta layout needed it; so each
    `aten.view` becomes `aten.reshape`, which is the same view wherever the view is possible and a
    copy where the real layout forbids it, rather than an error.
    """

    def swap(value: Any) -> Any:
        is_meta = isinstance(value, torch.device) and value.type == "meta"
        return device if is_meta else value

    for node in gm.graph.nodes:
        node.args = tree_map(swap, node.args)
        node.kwargs = tree_map(swap, node.kwargs)
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    gm.recompile()


def _real(owner: Any, rest: str, node: torch.fx.Node, gm: torch.fx.GraphModule) -> Any:
    """The attribute `rest` of the model (or loss function) `owner`, checked against the capture."""
    captured = fetch(gm, str(node.target))
    try:
        value = fetch(owner, rest) if rest else owner
    except AttributeError as exc:
        raise CaptureError(
            f"the model built for training has no attribute {rest!r}, which the captured graph reads at op "
            f"%{node.name}: the factory builds a different model on the meta device than on the real one; "
            "build the same modules on every device"
        ) from exc
    if isinstance(captured, torch.Tensor) and (
        not isinstance(value, torch.Tensor) or value.shape != captured.shape or value.dtype != captured.dtype
    ):
        got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise CaptureError(
            f"tensor {node.target!r} is {tuple(captured.shape)} {captured.dtype} in the captured graph but {got} in "
            "the model built for training: the factory builds a different model on the meta device than on the "
            "real one; give it the same shapes and dtypes on every device"
        )
    return value


def _constant(value: Any, node: torch.fx.Node) -> Any:
    if not isinstance(value, torch.Tensor) or value.device != _META:
        return value
    if value.numel() == 0:
        return torch.empty(value.shape, dtype=value.dtype)
    raise CaptureError(
        f"the captured graph reads a constant {node.target!r} (op %{node.name}, shape {tuple(value.shape)}) that the "
        "model's forward created on the model's device, which was the meta device during capture, so its values "
        "are unknown; create it on the CPU (torch.tensor(...) without device=) and move it, or register it as a "
        "buffer in __init__"
    )
