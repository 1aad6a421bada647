"""The device a model's code sees while capture traces it on the meta device.

Capture runs the model's Python on fake tensors made from meta tensors, so code that asks where its
tensors live reads `meta`. Libraries pick kernels by that answer: transformers' mixture-of-experts
layer counts the tokens per expert with `histc` on float ids on the CPU (whose `histc` has no
integer kernel) and on int ids anywhere else, so a capture on meta records the integer `histc`,
which the CPU then cannot run. Every such branch in any model goes the same way.

`presenting(device)` makes the fake tensors of an export trace report `device` instead of meta
(their storage stays meta: no memory is taken), so the model's code takes the branch it takes on
the device the plan trains on. `to_meta_literals` then turns the device literals the trace recorded
for that device (`arange(..., device=cpu)`) back into meta ones, so the graph is the meta-device
graph the rest of capture expects, and the runtime retargets it to the device it trains on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map

from dapple_ir.cluster.spec import ClusterSpec
from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.errors import ClusterError

__all__ = ["device_here_for", "presenting", "to_meta_literals", "trace_device_for"]

_META = torch.device("meta")

#: The device meta fake tensors report in this context (None: meta, as torch makes them).
_PRESENTED: ContextVar[torch.device | None] = ContextVar("dapple_presented_device", default=None)

#: torch's own normaliser of a fake tensor's device, which every fake tensor's device passes through
#: (absent before torch 2.5: fake tensors then report meta, as without this module).
_NORMALISE = "_normalize_fake_device"
_original_normalise: Any = None


def _normalise(device: torch.device) -> torch.device:
    presented = _PRESENTED.get()
    if presented is not None and device.type == "meta":
        device = presented
    return _original_normalise(device)  # type: ignore[no-any-return]


def _install() -> bool:
    """Route fake tensors' devices through `_normalise` (once per process; inert outside `presenting`)."""
    global _original_normalise
    if _original_normalise is not None:
        return True
    original = getattr(FakeTensor, _NORMALISE, None)
    if original is None:
        return False
    _original_normalise = original
    setattr(FakeTensor, _NORMALISE, staticmethod(_normalise))
    return True


def trace_device_for(cluster: str | ClusterSpec) -> str | None:
    """The device type capture presents for a plan on `cluster` (a spec, or the shorthand or TOML path that names
    one): `cpu` when its devices are CPUs, else None (meta, as torch makes it; a GPU's code path is the one a model
    takes off the CPU, and a capture for a GPU cluster must not depend on whether the planning machine has one).
    Compile and the runtime both ask this of the plan's cluster, so they capture the same graph. A cluster file no
    longer there counts as not CPU."""
    spec = _spec(cluster)
    if spec is None:
        return None
    return "cpu" if spec.node_kinds[0].name.lower().startswith("cpu") else None


def device_here_for(cluster: str | ClusterSpec) -> str | None:
    """The device type a plan on `cluster` trains on, where this machine has one (to try its ops on); else None."""
    spec = _spec(cluster)
    if spec is None:
        return None
    if trace_device_for(spec) == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


def _spec(cluster: str | ClusterSpec) -> ClusterSpec | None:
    """`cluster` resolved, where it is text; None where it names no readable cluster."""
    if isinstance(cluster, ClusterSpec):
        return cluster
    try:
        return resolve_cluster(cluster)
    except (ClusterError, OSError):
        return None


@contextlib.contextmanager
def presenting(device_type: str | None) -> Iterator[None]:
    """Within: fake tensors made from meta tensors report `device_type` (None: no change)."""
    if device_type is None or not _install():
        yield
        return
    token = _PRESENTED.set(torch.device(device_type))
    try:
        yield
    finally:
        _PRESENTED.reset(token)


def to_meta_literals(graph: torch.fx.Graph, device_type: str | None) -> None:
    """Device literals of `device_type` in `graph`'s arguments become meta (in place)."""
    if device_type is None:
        return

    def swap(value: Any) -> Any:
        if isinstance(value, torch.device) and value.type == device_type:
            return _META
        return value

    for node in graph.nodes:
        node.args = tree_map(swap, node.args)
        node.kwargs = tree_map(swap, node.kwargs)
