"""A model spec to its IR, without torch for a profile.

`profile:path/graph.txt` is read by `profile_import`, which needs no torch, so planning a published
profile starts in well under a second; a Python spec (`file.py:factory`) is captured through
`model_spec`, which imports torch only then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dapple_ir.frontend.profile_import import import_profile_spec, is_profile_spec
from dapple_ir.ir import Module

if TYPE_CHECKING:
    from dapple_ir.cluster.spec import ClusterSpec


def capture_spec(
    spec: str,
    *,
    method: str = "auto",
    device: str = "meta",
    seed: int = 0,
    profile_batch: int | None = None,
    notes: list[str] | None = None,
    cluster: str | ClusterSpec | None = None,
) -> Module:
    """The IR of the model a spec names: imported from a profile, or captured from its factory.

    The capture's notes (a method that failed before another worked, ops left without costs) are
    appended to `notes` when given. For a plan on `cluster` (a resolved spec, or the text that names
    one), the model's code sees its tensors on that cluster's device type while it is traced
    (`trace_device.trace_device_for`), and where this machine has that device, every op of the graph
    is tried on it once (`device_support`): a model the device cannot run is refused here.
    """
    if is_profile_spec(spec):
        return import_profile_spec(spec, profile_batch)
    # Only a Python spec needs torch: the import stays here so that profiles never load it.
    from dapple_ir.frontend.device_support import check_device_support
    from dapple_ir.frontend.model_spec import FactoryResult, capture_loaded, load_model_spec
    from dapple_ir.frontend.trace_device import device_here_for, trace_device_for

    loaded = load_model_spec(spec, device=device, seed=seed)
    assert isinstance(loaded, FactoryResult)  # profiles were handled above
    trace_device = trace_device_for(cluster) if cluster else None
    captured = capture_loaded(loaded, method=method, trace_device=trace_device)
    runs_on = device_here_for(cluster) if cluster else None
    if runs_on is not None:
        # Refused now rather than in the first forward of a run (device_support's docstring).
        check_device_support(captured.graph_module, runs_on, spec)
    if notes is not None:
        notes.extend(captured.notes)
    return captured.module
