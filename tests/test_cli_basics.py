"""The `dapple` command as a user meets it: version, passes, opt, and errors without tracebacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "ir" / "all_shapes.dapple"


def dapple(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dapple_ir.cli", *args], input=stdin, capture_output=True, text=True, timeout=120
    )


def test_version() -> None:
    result = dapple("--version")
    assert result.returncode == 0 and result.stdout.startswith("dapple-ir ")


def test_passes_lists_every_registered_pass_with_options() -> None:
    result = dapple("passes", "--pass-plugin", str(ROOT / "examples" / "custom_pass.py"))
    assert result.returncode == 0, result.stderr
    assert "dce  —  Remove ops whose results are never read" in result.stdout
    assert "pin-module  —  Move every op" in result.stdout
    assert "    stage: int (default: 0)  0-based index of the stage to pin it to" in result.stdout


def test_opt_prints_the_ir_after_passes(tmp_path: Path) -> None:
    result = dapple("opt", str(GOLDEN), "-p", "dce,verify", "--dump-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    # %node7 has no users and no output reads it: dce removes it, the rest prints unchanged.
    expected = "".join(line for line in GOLDEN.read_text().splitlines(keepends=True) if "%node7 = layer" not in line)
    assert result.stdout == expected.replace(", %node7", "")
    assert (tmp_path / "002_verify.dapple").read_text() == result.stdout


def test_opt_reads_stdin() -> None:
    result = dapple("opt", "-", stdin="module @m {\n}\n")
    assert result.returncode == 0 and result.stdout == "module @m {\n}\n"


def test_malformed_ir_is_one_paragraph_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.dapple"
    bad.write_text("module @m {\n  %x = input : f32[3\n}\n")
    result = dapple("opt", str(bad))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: {bad}:3:1: unexpected")
    assert "expected one of: ',', ']'" in result.stderr


def test_unknown_pass_is_one_line_without_traceback() -> None:
    result = dapple("opt", str(GOLDEN), "-p", "dce,no-such-pass")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "unknown pass 'no-such-pass'; registered passes are: " in result.stderr


def test_missing_file() -> None:
    result = dapple("opt", "nowhere.dapple")
    assert result.returncode == 2 and "IR file nowhere.dapple does not exist" in result.stderr


def test_every_command_has_help_with_an_example() -> None:
    from dapple_ir.cli import command_names

    for name in command_names():
        result = dapple(name, "--help")
        assert result.returncode == 0, (name, result.stderr)
        assert "example" in result.stdout, f"`dapple {name} --help` shows no example"
