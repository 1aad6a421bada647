"""Golden pass tests, filecheck style: IR text in, `dapple opt -p PIPELINE`, expected IR text out.

Drop a file into `tests/golden/<pass>/` to add a case. A case file is `NAME.dapple` or `NAME.in.dapple`
whose header comments say what to run:

    // RUN: schedule{kind=1f1b,microbatches=4},lower-comm    (the pipeline; required)
    // ARGS: --cluster 1x4xV100-16GB                          (more `dapple opt` flags; optional)
    // ERROR: does not divide                                 (the run must fail with this text; optional)

The expected output follows a line `// CHECK:` in the same file, or sits in a sibling `NAME.expected`
(or `NAME.out.dapple` next to `NAME.in.dapple`). The command runs in the case's folder, so relative
paths in options (`from=order.csv`) resolve next to it. `DAPPLE_UPDATE_GOLDEN=<folder>,... pytest ...`
rewrites those folders' expected outputs from what the passes print now; check them by hand before keeping.
"""

from __future__ import annotations

import io
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from dapple_ir.cli import main

GOLDEN = Path(__file__).parent / "golden"
_CHECK = "// CHECK:"


@dataclass
class Case:
    path: Path
    pipeline: str
    args: list[str]
    error: str | None
    source: str
    expected_path: Path | None

    def expected(self) -> str:
        if self.expected_path is not None:
            return self.expected_path.read_text() if self.expected_path.exists() else ""
        return self.path.read_text().split(_CHECK + "\n", 1)[1]


def _header(text: str, key: str) -> str | None:
    for line in text.splitlines():
        if line.startswith(f"// {key}:"):
            return line.split(":", 1)[1].strip()
    return None


def _cases() -> list[Case]:
    cases = []
    for path in sorted(GOLDEN.glob("*/*.dapple")):
        if path.name.endswith(".out.dapple"):
            continue
        text = path.read_text()
        pipeline = _header(text, "RUN")
        if pipeline is None:
            continue  # not a pass case (a round-trip file, say)
        stem = path.name.removesuffix(".dapple").removesuffix(".in")
        expected_path = None
        if _CHECK + "\n" not in text:
            sibling = path.with_name(stem + (".out.dapple" if path.name.endswith(".in.dapple") else ".expected"))
            expected_path = sibling
        source = text.split(_CHECK + "\n", 1)[0]
        args = shlex.split(_header(text, "ARGS") or "")
        cases.append(Case(path, pipeline, args, _header(text, "ERROR"), source, expected_path))
    return cases


CASES = _cases()


def test_golden_cases_exist_for_lowering() -> None:
    folders = {c.path.parent.name for c in CASES}
    assert {"schedule", "lower_comm", "insert_frees"} <= folders


@pytest.mark.parametrize("case", CASES, ids=[f"{c.path.parent.name}/{c.path.name}" for c in CASES])
def test_golden(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(case.path.parent)
    monkeypatch.setattr("sys.stdin", io.StringIO(case.source))
    out = tmp_path / "out.dapple"
    code = main(["opt", "-", "-p", case.pipeline, "-o", str(out), *case.args])
    err = capsys.readouterr().err
    if case.error is not None:
        assert code != 0, f"{case.path.name}: expected an error containing {case.error!r}, but the run passed"
        assert case.error in err, err
        return
    assert code == 0, err
    got = out.read_text()
    if _updating(case):
        _update(case, got)
        return
    assert got == case.expected(), f"{case.path}: output differs from the expected IR"


def _updating(case: Case) -> bool:
    """`DAPPLE_UPDATE_GOLDEN=schedule,lower_comm` rewrites those folders' cases (`all`: every folder)."""
    folders = os.environ.get("DAPPLE_UPDATE_GOLDEN", "").split(",")
    return "all" in folders or case.path.parent.name in folders


def _update(case: Case, got: str) -> None:
    if case.expected_path is not None:
        case.expected_path.write_text(got)
        return
    case.path.write_text(case.source + _CHECK + "\n" + got)
