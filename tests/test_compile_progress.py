"""`dapple compile`'s progress on stderr: each phase as it ends, after the seconds since the start, in
order; `--quiet` prints none of it; the planner reports its candidates as it simulates them."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from dapple_ir.api import compile as compile_plan
from dapple_ir.cli import main
from dapple_ir.planner.cost_model import Candidate, Problem
from dapple_ir.planner.scoring import SearchProgress
from tests.paths import PROFILES

GPT = ["compile", "examples/gpt.py:factory", "--cluster", "2xcpu", "--global-batch", "8"]
PHASES = [
    "capture",
    "tensor-parallel",
    "annotate-cost",
    "coarsen",
    "plan",
    "schedule",
    "lower-comm",
    "insert-frees",
    "verify",
    "write",
]
LINE = re.compile(r"^\[ *(\d+\.\d) s\] ([a-z-]+): (.*)$")


def test_compile_prints_its_phases_in_order_with_their_times(tmp_path: Path, capsys) -> None:
    assert main([*GPT, "-o", str(tmp_path / "plan")]) == 0
    lines = capsys.readouterr().err.splitlines()
    matched = [LINE.match(line) for line in lines]
    assert all(matched), lines
    elapsed = [float(m.group(1)) for m in matched if m]
    assert elapsed == sorted(elapsed)
    # Each phase's line saying it ended, with its time: the capture's, each pass's, and the writing's.
    ended = [m.group(2) for m in matched if m and re.search(r"\bin \d+\.\d\d s$", m.group(3))]
    assert ended == PHASES, lines
    assert any(
        re.fullmatch(r"plan: \d+ candidates gathered, \d+ simulated.*", line.split("] ", 1)[1]) for line in lines
    )


def test_quiet_prints_no_progress(tmp_path: Path, capsys) -> None:
    assert main([*GPT, "-o", str(tmp_path / "plan"), "--quiet"]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    assert "wrote" in out.out


def test_quiet_keeps_errors(tmp_path: Path, capsys) -> None:
    assert main([*GPT, "-o", str(tmp_path / "plan"), "--quiet", "--microbatches", "3"]) != 0
    assert "error:" in capsys.readouterr().err


def _fits_in(capacity: float) -> Problem:
    """A stand-in problem: the progress reads only its devices' capacity."""
    return SimpleNamespace(capacity=lambda _device: capacity)  # type: ignore[return-value]


def test_search_progress_counts_the_simulations_and_keeps_the_best_that_fits() -> None:
    lines: list[str] = []
    progress = SearchProgress(lines.append, interval_s=0.0)
    results = iter([(2.0, 1.0), (1.0, 1e30), (1.5, 1.0)])  # the second does not fit in memory
    score = progress.counting(lambda problem, cand: next(results))
    progress.found(40)
    for _ in range(3):
        score(_fits_in(10.0), Candidate(stages=(), microbatches=1))
    assert lines == [
        "plan: 40 candidates gathered, 0 simulated",
        "plan: 40 candidates gathered, 1 simulated, best 2.000 s",
        "plan: 40 candidates gathered, 2 simulated, best 2.000 s",
        "plan: 40 candidates gathered, 3 simulated, best 1.500 s",
    ]


def test_search_progress_is_rate_limited() -> None:
    lines: list[str] = []
    progress = SearchProgress(lines.append, interval_s=3600.0)
    score = progress.counting(lambda problem, cand: (1.0, 0.0))
    for _ in range(5):
        score(_fits_in(1.0), Candidate(stages=(), microbatches=1))
    assert progress.simulated == 5 and len(lines) == 1


def test_the_planner_reports_its_search_through_the_log() -> None:
    lines: list[str] = []
    compile_plan(
        f"profile:{PROFILES / 'dapple-vgg-19-pbs-32.txt'}", cluster="2x8xV100-16GB", global_batch=512, log=lines.append
    )
    searched = [line for line in lines if re.fullmatch(r"plan: \d+ candidates gathered, \d+ simulated.*", line)]
    assert searched, lines
    assert lines.index(searched[0]) < lines.index(next(line for line in lines if line.startswith("plan: done in")))


def test_a_phase_that_runs_long_says_it_is_still_working(capsys: pytest.CaptureFixture[str]) -> None:
    """A 70B capture runs 30 s in one call: the progress prints `still working` every `quiet_s` without a line."""
    import contextlib
    import io
    import time

    from dapple_ir.commands.compile import Progress

    progress = Progress(time.perf_counter(), quiet_s=0.2)
    progress("capture: started")
    # Capture swaps sys.stderr to silence torch while it traces: the progress still reaches the terminal.
    with contextlib.redirect_stderr(io.StringIO()):
        time.sleep(0.9)
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("capture: started")
    still = [line for line in lines if "still working" in line]
    assert len(still) >= 2
    assert not progress.watcher.is_alive()
