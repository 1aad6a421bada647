"""docs/passes.md is what the registry says, and docs/custom-pass.md's tutorial works as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from dapple_ir.commands.passes import passes_markdown
from dapple_ir.plugins import all_passes

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_passes_md_is_in_sync_with_the_registry() -> None:
    expected = passes_markdown()
    assert (DOCS / "passes.md").read_text() == expected, "regenerate: dapple passes --markdown > docs/passes.md"
    for name, cls in all_passes().items():
        if cls.__module__.startswith("dapple_ir.passes."):
            assert f"## `{name}`" in expected


def test_custom_pass_tutorial_runs_as_written(tmp_path: Path) -> None:
    text = (DOCS / "custom-pass.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    (ir,) = re.findall(r"```dapple\n(.*?)```", text, flags=re.S)
    (command,) = re.findall(r"```console\n\$ (dapple opt .*?)\n", text, flags=re.S)
    (tmp_path / "pin_module.py").write_text(code)
    (tmp_path / "planned.dapple").write_text(ir)
    args = command.split()[1:]
    args = [a.strip("'") for a in args]
    result = subprocess.run(
        [sys.executable, "-m", "dapple_ir.cli", *args], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    shown = re.findall(r"```console\n\$ dapple opt .*?\n(.*?)```", text, flags=re.S)[0]
    assert result.stdout == shown
