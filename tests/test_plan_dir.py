"""Plan directories lose nothing: compile never deletes what dapple-ir did not write, replaces a previous
plan only once the new one is complete, refuses a file as output, and gives normal permissions
(issue 18, item 1)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dapple_ir.api import compile as compile_plan
from dapple_ir.cli import main
from dapple_ir.errors import DappleError
from tests.paths import PROFILES

VGG19 = f"profile:{PROFILES / 'dapple-vgg-19-pbs-32.txt'}"


def _compile(out: Path, **kwargs: object) -> None:
    compile_plan(VGG19, cluster="1x4xV100-16GB", global_batch=64, out_dir=out, **kwargs)  # type: ignore[arg-type]


def test_a_directory_with_other_files_is_refused_before_any_work(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    with pytest.raises(DappleError, match=r"holds files dapple-ir did not write \(thesis.tex\).*--force"):
        _compile(out)
    assert (out / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no temporary directory left behind


def test_force_replaces_it(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("x")
    _compile(out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["plan.dapple", "plan.json", "report.txt"]


def test_a_previous_plan_is_replaced_and_its_simulation_files_with_it(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    _compile(out)
    assert main(["simulate", str(out), "--no-picture"]) == 0
    assert (out / "timeline.json").is_file()
    _compile(out)
    assert sorted(p.name for p in out.iterdir()) == ["plan.dapple", "plan.json", "report.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]


def test_a_failed_compile_keeps_the_previous_plan(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    _compile(out)
    before = (out / "plan.dapple").read_text()
    with pytest.raises(DappleError):
        compile_plan(VGG19, cluster="1x4xV100-16GB", global_batch=64, stages=99, out_dir=out)
    assert (out / "plan.dapple").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]


def test_an_output_that_is_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "P"
    target.write_text("keep me")
    code = main(["compile", VGG19, "--cluster", "1x4xV100-16GB", "--global-batch", "64", "-o", str(target)])
    assert code != 0
    assert "is a file, not a directory" in capsys.readouterr().err
    assert target.read_text() == "keep me"


def test_plan_directories_get_the_usual_permissions(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    old = os.umask(0o022)
    try:
        _compile(out)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


@pytest.mark.parametrize("where", ["/proc/nope/P", "/dev/null/P"])
def test_an_output_nobody_can_write_is_a_clear_error(where: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["compile", VGG19, "--cluster", "1x4xV100-16GB", "--global-batch", "64", "-o", where])
    assert code != 0
    err = capsys.readouterr().err
    assert f"cannot write the plan directory {where}" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--global-batch", "1000000000000"], "at most 16,777,216 samples per step, not 1,000,000,000,000"),
        (["--global-batch", "99999999999999999999999"], "at most 16,777,216 samples per step"),
        (["--global-batch", "64", "--stages", "99999999999999999999"], "--stages must lie between 1 and"),
    ],
)
def test_unbounded_numbers_are_refused_at_once(
    flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["compile", VGG19, "--cluster", "1x4xV100-16GB", "-o", "unused", *flags]
    assert main(args) != 0
    assert needle in capsys.readouterr().err
