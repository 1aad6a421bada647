"""Whether the device a plan trains on can run every op of its captured graph, found at compile time.

Capture traces on the meta device, whose kernels accept every dtype; a real device's kernel may not
(the CPU's `histc` has no integer kernel). Such an op would fail in the first forward of a run,
after the launch, so compile runs each op of the graph once on the device, on real tensors of its
recorded dtypes, and refuses the model when one has no kernel there.

Ops of the same callee, dtypes and shapes (a transformer's blocks) are probed once. An op whose
tensors exceed `PROBE_BYTES` runs on tensors with every dimension cut to at most 2 (a kernel's
dtype support does not depend on sizes); where that fails for a reason of shapes, the op counts as
runnable. Integer tensors hold zeros (valid indices), floating ones values in [0, 1): only a missing
kernel refuses a model, never an error of values. `call_module` ops (fx's built-in layers) are
`torch.nn` modules, which every device runs, and are not probed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_leaves, tree_map

from dapple_ir.errors import CaptureError
from dapple_ir.frontend.module_paths import op_path
from dapple_ir.frontend.source_locations import location

__all__ = ["PROBE_BYTES", "Unsupported", "check_device_support", "unsupported_ops"]

#: Largest tensors (inputs, in bytes) an op is probed with at their recorded shapes.
PROBE_BYTES = 16 * 2**20

#: What torch says when a kernel is missing for a device or dtype (anything else is not about support).
_MISSING = re.compile(r"not implemented for|Could not run|no kernel|not supported on|NotImplemented", re.IGNORECASE)


@dataclass(frozen=True)
class Unsupported:
    """An op of the graph that the device cannot run."""

    node: str
    """The op's name in the graph (its IR name)."""
    target: str
    """The callee (`aten.histc.default`)."""
    inputs: str
    """Its tensor inputs' types (`i32[128]`)."""
    message: str
    """What torch said."""
    where: str
    """Module path and source line, as far as known."""


def _describe(value: Any) -> str:
    return f"{str(value.dtype).removeprefix('torch.')}[{','.join(map(str, value.shape))}]"


def _real(value: Any, device: torch.device, shrink: bool) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    shape = tuple(min(d, 2) for d in value.shape) if shrink else tuple(value.shape)
    if value.dtype.is_floating_point or value.dtype.is_complex:
        return torch.rand(shape, dtype=value.dtype, device=device)
    return torch.zeros(shape, dtype=value.dtype, device=device)


def _example(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def _probe(node: torch.fx.Node, device: torch.device) -> str | None:
    """What torch said if `node`'s kernel is missing on `device`; None when it ran (or failed otherwise)."""
    args, kwargs = tree_map(_example, (node.args, node.kwargs))
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    shrink = sum(math.prod(t.shape) * t.element_size() for t in tensors) > PROBE_BYTES
    # The graph's device literals are meta (the runtime retargets them to its device, as here).
    real_args, real_kwargs = tree_map(
        lambda v: device if isinstance(v, torch.device) else _real(v, device, shrink), (args, kwargs)
    )
    try:
        with torch.no_grad():
            if node.op == "call_method":
                getattr(real_args[0], str(node.target))(*real_args[1:], **real_kwargs)
            else:
                node.target(*real_args, **real_kwargs)  # type: ignore[operator]
    except NotImplementedError as exc:
        return str(exc).splitlines()[0]
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return first if _MISSING.search(first) else None
    return None


def _signature(node: torch.fx.Node) -> Any:
    def sig(value: Any) -> Any:
        value = _example(value)
        if isinstance(value, torch.Tensor):
            return ("tensor", value.dtype, tuple(value.shape))
        return repr(value)

    return (node.op, str(node.target), tuple(sig(v) for v in tree_leaves((node.args, node.kwargs))))


def unsupported_ops(gm: torch.fx.GraphModule, device: torch.device) -> list[Unsupported]:
    """The ops of `gm` (with example values in `node.meta["val"]`) that have no kernel on `device`."""
    found: list[Unsupported] = []
    seen: set[Any] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        key = _signature(node)
        if key in seen:
            continue
        seen.add(key)
        message = _probe(node, device)
        if message is None:
            continue
        inputs = [_describe(v) for v in tree_leaves(tree_map(_example, node.args)) if isinstance(v, torch.Tensor)]
        where = ", ".join(w for w in (op_path(node) and f"in {op_path(node)}", location(node)) if w)
        found.append(Unsupported(node.name, str(node.target), ", ".join(inputs), message, where or "in the model"))
    return found


def check_device_support(gm: torch.fx.GraphModule, device_type: str, source: str) -> None:
    """Refuse the model of `source` when `gm` has an op that `device_type` cannot run (see the module docstring)."""
    missing = unsupported_ops(gm, torch.device(device_type))
    if not missing:
        return
    first = missing[0]
    others = f" ({len(missing) - 1} more op(s) fail the same way)" if len(missing) > 1 else ""
    raise CaptureError(
        f"{source}: op %{first.node} ({first.target} on {first.inputs or 'no tensors'}, {first.where}) cannot run on "
        f"the {device_type.upper()} this plan trains on (torch: {first.message}){others}. Training would fail "
        f"in its first forward, so compile stops here. Make the model call it on a dtype the {device_type.upper()} "
        "supports (a cast before the op, or a library option that picks another implementation), or plan for a "
        "cluster whose devices have the kernel"
    )
