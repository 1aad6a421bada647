"""The built wheel holds the mapped packages and the grammar, and installs a working `dapple`."""

from __future__ import annotations

import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_contents(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("dapple_ir-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for required in (
        "dapple_ir/__init__.py",
        "dapple_ir/ir/core.py",
        "dapple_ir/grammars/dapple.lark",
        "dapple_ir/passes/__init__.py",
        "dapple_ir/passes/dce.py",
        "dapple_ir/backends/__init__.py",
        "dapple_ir/backends/torch/__init__.py",
        "dapple_ir/commands/opt.py",
    ):
        assert required in names, f"{required} missing from {wheel.name}"
    # The mapped folders never install as top-level packages of their own.
    assert not any(n.startswith(("passes/", "backends/", "grammars/")) for n in names)
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "dapple = dapple_ir.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    # Installed into a fresh venv, `dapple` works. The venv sees this one's dependencies through a
    # .pth path entry (which does not activate this checkout's editable install).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (site_dir,) = venv.glob("lib/python*/site-packages")
    (site_dir / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    out = subprocess.run(
        [str(venv / "bin" / "dapple"), "passes"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert "dce" in out.stdout
