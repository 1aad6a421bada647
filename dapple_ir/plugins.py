"""Where passes (and schedules) come from: the built-ins in `dapple_ir.passes`, packages that name a
module in the entry-point group `dapple_ir.passes`, and plugin files (`--pass-plugin file.py`).

Each of them registers by running `@register_pass` (or `@register_schedule`) when imported; this
module only imports them. The registry itself is `dapple_ir.registry`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

from dapple_ir.errors import PassOptionError
from dapple_ir.registry import Pass, registered_passes

ENTRY_POINT_GROUP = "dapple_ir.passes"
_loaded = {"builtins": False}


def load_builtins() -> None:
    """Import the built-in passes and every module the entry-point group names (once)."""
    if _loaded["builtins"]:
        return
    _loaded["builtins"] = True
    importlib.import_module("dapple_ir.passes")
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        entry.load()


def all_passes() -> dict[str, type[Pass]]:
    """Every registered pass by name, built-ins and entry points included, sorted by name."""
    load_builtins()
    return registered_passes()


def load_plugin(path: str | Path) -> None:
    """Execute a Python file whose `@register_pass` classes then join the registry."""
    path = Path(path)
    if not path.is_file():
        raise PassOptionError(f"pass plugin {path} does not exist")
    module_name = f"dapple_ir_plugin_{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
