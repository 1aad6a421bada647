"""A plan directory owns what the product wrote and nothing else (issue 47, items 3-5): no write or delete follows a
symbolic link it did not make, `compile -o` replaces only files its digest lists, and a compile killed between its
two renames is recovered by the next one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dapple_ir.cli import main
from dapple_ir.errors import DappleError
from dapple_ir.plan_dir import check_output
from tests.paths import PROFILES, ROOT

VGG19 = PROFILES / "dapple-vgg-19-pbs-32.txt"
COMPILE = ["compile", f"profile:{VGG19}", "--cluster", "2x2xV100-16GB", "--global-batch", "32", "-o"]


@pytest.fixture
def profile_plan(tmp_path: Path) -> Path:
    out = tmp_path / "plan"
    assert main([*COMPILE, str(out)]) == 0
    return out


def _outside(tmp_path: Path) -> Path:
    """A directory outside the plan holding a user's files, each named as a file the product writes."""
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("victim.json", "victim.png", "rank_9.json", "notes.tmp", "torchrun.log", "heartbeat_rank_0.json"):
        (outside / name).write_text(f"the user's {name}\n")
    return outside


def _untouched(outside: Path) -> None:
    for path in outside.iterdir():
        assert path.read_text() == f"the user's {path.name}\n", f"{path} was written through a link"


# ------------------------------------------------------------------------------ symbolic links (item 3)


def test_simulate_replaces_links_and_never_writes_through_them(tmp_path: Path, profile_plan: Path) -> None:
    """Before: `timeline.json` and `timeline.png` links were followed and the outside files overwritten."""
    outside = _outside(tmp_path)
    (profile_plan / "timeline.json").symlink_to(outside / "victim.json")
    (profile_plan / "timeline.png").symlink_to(outside / "victim.png")
    assert main(["simulate", str(profile_plan)]) == 0
    _untouched(outside)
    for name in ("timeline.json", "timeline.png"):
        assert not (profile_plan / name).is_symlink() and (profile_plan / name).stat().st_size > 100
    assert json.loads((profile_plan / "timeline.json").read_text())["traceEvents"]
    assert not list(profile_plan.glob(".*tmp*"))


@pytest.fixture(scope="module")
def torch_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.test_runtime import MLP, make_plan

    return make_plan(tmp_path_factory.mktemp("links") / "plan", MLP, stages=2, kind="1f1b")


def test_run_refuses_a_run_folder_that_is_a_link(tmp_path: Path, torch_plan: Path) -> None:
    """Before: `run/` was followed, and the outside directory's `rank_9.json`, `notes.tmp`, `torchrun.log` deleted."""
    from dapple_ir.backends.torch.launch import run

    outside = _outside(tmp_path)
    link = torch_plan / "run"
    if link.exists():
        shutil.rmtree(link)
    link.symlink_to(outside, target_is_directory=True)
    try:
        with pytest.raises(DappleError, match=r"run is a symbolic link \(to .*outside\); `dapple run` writes"):
            run(torch_plan, steps=1, transport="threads")
    finally:
        link.unlink()
    _untouched(outside)
    assert len(list(outside.iterdir())) == 6


def test_run_replaces_a_measured_timeline_link(tmp_path: Path, torch_plan: Path) -> None:
    """Before: the measured timeline was written through a `timeline_measured.json` link."""
    from dapple_ir.backends.torch.launch import run

    outside = _outside(tmp_path)
    measured = torch_plan / "timeline_measured.json"
    measured.unlink(missing_ok=True)
    measured.symlink_to(outside / "victim.json")
    run(torch_plan, steps=1, transport="threads")
    _untouched(outside)
    assert not measured.is_symlink() and json.loads(measured.read_text())["traceEvents"]


# ------------------------------------------------------------------------------ ownership by the digest (item 4)


@pytest.mark.parametrize(
    "plant",
    [
        lambda out: (out / "rank_0.py").mkdir() or (out / "rank_0.py" / "notes.txt").write_text("mine"),
        lambda out: (out / "report.txt").write_text("mine"),
        lambda out: (out / "rank_3.py").write_text("mine"),
        lambda out: (out / "timeline.json").symlink_to(out.parent / "elsewhere.json"),
    ],
    ids=["rank-file-dir", "own-report", "unlisted-rank-file", "linked-timeline"],
)
def test_compile_keeps_user_files_with_plan_like_names(tmp_path: Path, profile_plan: Path, plant: object) -> None:
    """Before: `rank_0.py/notes.txt` and a hand-written `report.txt` were deleted by `compile -o`, exit 0."""
    (tmp_path / "elsewhere.json").write_text("mine")
    plant(profile_plan)  # type: ignore[operator]
    before = sorted(str(p.relative_to(profile_plan)) for p in profile_plan.rglob("*"))
    with pytest.raises(
        DappleError, match=r"holds files dapple-ir did not write \((rank_0\.py|report\.txt|rank_3\.py|timeline\.json)\)"
    ):
        compile_plan(str(VGG19), profile_plan)
    assert sorted(str(p.relative_to(profile_plan)) for p in profile_plan.rglob("*")) == before


def test_a_directory_of_plan_names_without_a_sealed_plan_json_is_not_a_plan(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for name in ("plan.dapple", "report.txt", "timeline.json"):
        (out / name).write_text("mine")
    (out / "plan.json").write_text('{"digest": "forged"}')
    with pytest.raises(DappleError, match=r"holds files dapple-ir did not write \(plan.dapple, plan.json, report"):
        compile_plan(str(VGG19), out)


def test_a_plan_with_its_simulation_files_is_replaced_whole(profile_plan: Path) -> None:
    assert main(["simulate", str(profile_plan)]) == 0
    compile_plan(str(VGG19), profile_plan)
    assert sorted(p.name for p in profile_plan.iterdir()) == ["plan.dapple", "plan.json", "report.txt"]


def compile_plan(spec: str, out: Path) -> None:
    from dapple_ir.api import compile as compile_api

    compile_api(f"profile:{spec}", cluster="2x2xV100-16GB", global_batch=32, out_dir=out)


# ------------------------------------------------------------------------------ a compile killed between renames (5)

#: `dapple compile` in a process of its own that SIGKILLs itself as it renames the new plan into place: the
#: previous plan is at `.plan.old-PID`, the new one in its temporary directory, nothing at `plan`.
_KILLED_BETWEEN_RENAMES = """
import os, pathlib, signal, sys
rename = pathlib.Path.rename
def dying_rename(self, target):
    if pathlib.Path(target).name == "plan" and ".old-" not in self.name:
        os.kill(os.getpid(), signal.SIGKILL)
    return rename(self, target)
pathlib.Path.rename = dying_rename
from dapple_ir.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _kill_between_renames(out: Path) -> None:
    argv = [sys.executable, "-c", _KILLED_BETWEEN_RENAMES, *COMPILE, str(out)]
    killed = subprocess.run(argv, capture_output=True, timeout=300, cwd=ROOT)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert not out.exists()
    assert len(list(out.parent.glob(".plan.*"))) == 2  # the previous plan and the new one, beside it


def test_a_compile_killed_between_its_renames_is_recovered_by_the_next(tmp_path: Path, profile_plan: Path) -> None:
    """Before: no plan was left at `-o`, and `.plan.old-PID` and `.plan.XXXX` stayed forever."""
    previous = (profile_plan / "plan.json").read_bytes()
    _kill_between_renames(profile_plan)
    check_output(profile_plan)  # what the next compile does first
    assert (profile_plan / "plan.json").read_bytes() == previous  # the previous plan is back, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]
    _kill_between_renames(profile_plan)
    assert main([*COMPILE, str(profile_plan)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]
    load_plan_meta = json.loads((profile_plan / "plan.json").read_text())
    assert load_plan_meta["digest"]


def test_the_leftovers_of_a_running_compile_are_kept(tmp_path: Path) -> None:
    mine = tmp_path / f".plan.new-{os.getpid()}-abcd1234"
    mine.mkdir()
    check_output(tmp_path / "plan")
    assert mine.is_dir()
