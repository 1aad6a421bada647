"""Following the README word for word works: `examples/demo.py` runs its quickstart block."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from demo import quickstart_commands  # noqa: E402


def test_quickstart_block_is_what_the_demo_runs() -> None:
    commands = quickstart_commands()
    assert [c.split()[1] for c in commands] == ["compile", "simulate", "compile", "run"]
    assert all(c.startswith("dapple ") for c in commands)


@pytest.mark.slow
def test_readme_quickstart_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "plans"
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    big = json.loads((out / "gpt-2x8" / "plan.json").read_text())
    assert big["global_batch"] == 64 and big["cluster"] == "2x8xV100-16GB"
    assert all(peak <= 16e9 for peak in big["peak_bytes"].values())
    assert (out / "gpt-2x8" / "timeline.png").stat().st_size > 0
    assert (out / "gpt-cpu" / "timeline_measured.json").is_file()
    assert "timeline.png" in result.stdout
