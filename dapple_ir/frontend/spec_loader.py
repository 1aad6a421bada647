"""A model spec to its IR, without torch for a profile.

`profile:path/graph.txt` is read by `profile_import`, which needs no torch, so planning a published
profile starts in well under a second; a Python spec (`file.py:factory`) is captured through
`model_spec`, which imports torch only then.
"""

from __future__ import annotations

from dapple_ir.frontend.profile_import import import_profile_spec, is_profile_spec
from dapple_ir.ir import Module


def capture_spec(
    spec: str,
    *,
    method: str = "auto",
    device: str = "meta",
    seed: int = 0,
    profile_batch: int | None = None,
    notes: list[str] | None = None,
) -> Module:
    """The IR of the model a spec names: imported from a profile, or captured from its factory.

    The capture's notes (a method that failed before another worked, ops left without costs) are
    appended to `notes` when given.
    """
    if is_profile_spec(spec):
        return import_profile_spec(spec, profile_batch)
    # Only a Python spec needs torch: the import stays here so that profiles never load it.
    from dapple_ir.frontend.model_spec import FactoryResult, capture_loaded, load_model_spec

    loaded = load_model_spec(spec, device=device, seed=seed)
    assert isinstance(loaded, FactoryResult)  # profiles were handled above
    captured = capture_loaded(loaded, method=method)
    if notes is not None:
        notes.extend(captured.notes)
    return captured.module
