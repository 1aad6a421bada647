"""Plan directories lose nothing: compile never deletes what dapple-ir did not write, replaces a previous
plan only once the new one is complete, refuses a file as output, and gives normal permissions
(issue 18, item 1). Its digest covers plan.json, every plan file and the model spec's file, and is
checked before anything of the plan runs (issue 18, item 4)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

from dapple_ir.api import compile as compile_plan
from dapple_ir.backends.torch.launch import run
from dapple_ir.cli import main
from dapple_ir.errors import DappleError
from dapple_ir.plan_dir import PLAN_JSON, load_plan, write_plan_json
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


# ------------------------------------------------------------------ plan.json under the digest (item 4)

MARKER_MODEL = """
from pathlib import Path
Path(__file__).with_name("{marker}").write_text("ran")
import torch
from torch import nn

def factory():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    return model, (torch.randn(4, 4),), torch.nn.functional.mse_loss, (torch.randn(4, 1),)
"""


@pytest.fixture(scope="module")
def runnable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A runnable two-rank plan of a model file that leaves a marker file whenever it is run."""
    work = tmp_path_factory.mktemp("digest")
    model = work / "model.py"
    model.write_text(MARKER_MODEL.format(marker="ran-at-compile"))
    out = work / "plan"
    compile_plan(f"{model}:factory", cluster="1x2xcpu", global_batch=8, stages=2, out_dir=out)
    return out


@pytest.fixture
def plan(runnable: Path, tmp_path: Path) -> Path:
    """A private copy of the runnable plan and its model file (whose marker now says `ran`)."""
    copy = tmp_path / "plan"
    shutil.copytree(runnable, copy)
    model = tmp_path / "model.py"
    shutil.copy(runnable.parent / "model.py", model)
    meta = json.loads((copy / PLAN_JSON).read_text())
    meta["model_spec"] = f"{model}:factory"
    write_plan_json(copy, meta)
    model.write_text(MARKER_MODEL.format(marker="ran"))
    write_plan_json(copy, meta)  # the spec's hash as the file is now
    return copy


def _edit(plan: Path, reseal: bool = False, **fields: object) -> None:
    meta = json.loads((plan / PLAN_JSON).read_text())
    meta.update(fields)
    if reseal:
        write_plan_json(plan, meta)
    else:
        (plan / PLAN_JSON).write_text(json.dumps(meta))


def test_the_digest_covers_plan_json_every_file_and_the_model_spec(runnable: Path) -> None:
    meta = json.loads((runnable / PLAN_JSON).read_text())
    assert sorted(meta["files"]) == ["plan.dapple", "rank_0.py", "rank_1.py"]
    assert meta["files"]["rank_1.py"] == hashlib.sha256((runnable / "rank_1.py").read_bytes()).hexdigest()
    model = runnable.parent / "model.py"
    assert meta["model_spec_sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    body = {k: v for k, v in meta.items() if k != "digest"}
    expected = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert meta["digest"] == expected
    assert {"seed", "optimizer", "lr", "model_spec"} <= set(meta)
    assert load_plan(runnable).digest == expected


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"seed": 7}, "a changed seed"),
        ({"lr": 10.0}, "a changed learning rate"),
        ({"optimizer": "sgd"}, "a changed optimizer"),
        ({"model_spec": "evil.py:factory"}, "another model file"),
    ],
)
def test_an_edited_plan_json_is_refused(plan: Path, fields: dict[str, object], why: str) -> None:
    _edit(plan, **fields)
    with pytest.raises(
        DappleError, match=r"plan\.json was edited after compilation \(it no longer matches its digest\)"
    ):
        load_plan(plan)


def test_an_empty_plan_json_turns_nothing_off(plan: Path) -> None:
    (plan / PLAN_JSON).write_text("{}")
    with pytest.raises(DappleError, match=r"plan\.json carries no digest, so nothing vouches for the plan"):
        load_plan(plan)


def test_an_edited_rank_file_is_refused_by_the_digest(plan: Path) -> None:
    (plan / "rank_1.py").write_text((plan / "rank_1.py").read_text() + "\n# edited\n")
    with pytest.raises(DappleError, match=r"rank 1: .*rank_1\.py was edited after compilation"):
        load_plan(plan)


def test_nothing_runs_before_the_checks(plan: Path, tmp_path: Path) -> None:
    # A plan.json pointing at another model file (digest recomputed by hand would be needed) runs nothing...
    evil = tmp_path / "evil.py"
    evil.write_text(MARKER_MODEL.format(marker="evil-ran"))
    _edit(plan, model_spec=f"{evil}:factory")
    with pytest.raises(DappleError, match=r"plan\.json was edited"):
        run(plan, steps=1, transport="threads", timeout=10)
    assert not (tmp_path / "evil-ran").exists()
    # ...and neither does an edited model spec file, even under a resealed plan.json.
    _edit(plan, reseal=True, model_spec=f"{tmp_path / 'model.py'}:factory")
    (tmp_path / "model.py").write_text(MARKER_MODEL.format(marker="edited-ran"))
    with pytest.raises(DappleError, match=r"model\.py, the model spec file of plan .* changed since the plan was"):
        run(plan, steps=1, transport="threads", timeout=10)
    assert not (tmp_path / "edited-ran").exists()


def test_the_plan_runs_when_nothing_was_touched(plan: Path, tmp_path: Path) -> None:
    result = run(plan, steps=1, transport="threads", timeout=30)
    assert len(result.losses) == 1
    assert (tmp_path / "ran").exists()  # the control: the model file does run once the checks pass


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"lr": "fast"}, "field lr must be a positive finite number (or null: the optimizer's default), not 'fast'"),
        ({"lr": -1}, "field lr must be a positive finite number"),
        ({"seed": "abc"}, "field seed must be a whole number from 0 to 2**63 - 1, not 'abc'"),
        ({"seed": 2**64}, "field seed must be a whole number"),
        ({"optimizer": 3}, "field optimizer must be a string"),
    ],
)
def test_bad_values_in_a_sealed_plan_json_are_refused_at_load(
    plan: Path, fields: dict[str, object], needle: str
) -> None:
    _edit(plan, reseal=True, **fields)
    with pytest.raises(DappleError) as info:
        load_plan(plan)  # in the launching process, before any worker
    assert needle in str(info.value)


def test_a_module_spec_is_hashed_and_found_again_in_a_fresh_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "digest_mod_model.py").write_text(MARKER_MODEL.format(marker="ran"))
    compile_plan("digest_mod_model:factory", cluster="1x2xcpu", global_batch=8, stages=2, out_dir=tmp_path / "p")
    meta = json.loads((tmp_path / "p" / PLAN_JSON).read_text())
    assert meta["model_spec_sha256"] == hashlib.sha256((tmp_path / "digest_mod_model.py").read_bytes()).hexdigest()
    # As `dapple run` starts: the current directory not on the path, the module not imported yet.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "digest_mod_model")
    assert load_plan(tmp_path / "p").meta["model_spec_sha256"] == meta["model_spec_sha256"]
    (tmp_path / "digest_mod_model.py").write_text(MARKER_MODEL.format(marker="edited"))
    with pytest.raises(DappleError, match=r"digest_mod_model\.py, the model spec file of plan .* changed"):
        load_plan(tmp_path / "p")


def test_a_plan_that_was_run_is_replaced_with_its_run_but_a_foreign_file_in_run_is_kept(tmp_path: Path) -> None:
    # `make demo` compiles, runs and compiles again into the same directories: the reports `dapple run` wrote
    # into plan/run are dapple-ir's and belong to the old plan; anything else there is the user's.
    out = tmp_path / "plan"
    mlp = str(Path(__file__).resolve().parents[1] / "examples" / "mlp.py") + ":factory"
    compile_plan(mlp, cluster="2xcpu", global_batch=8, stages=2, out_dir=out)
    run(out, steps=1, transport="threads", timeout=30)
    assert (out / "run").is_dir()  # torchrun ranks write their reports there (the threads transport none)
    (out / "run" / "torchrun.log").write_text("what a torchrun launch logs")
    compile_plan(mlp, cluster="2xcpu", global_batch=8, stages=2, out_dir=out)
    assert not (out / "run").exists()
    run(out, steps=1, transport="threads", timeout=30)
    (out / "run" / "my_notes.txt").write_text("keep me")
    with pytest.raises(DappleError, match=r"holds files dapple-ir did not write \(run\)"):
        compile_plan(mlp, cluster="2xcpu", global_batch=8, stages=2, out_dir=out)
    assert (out / "run" / "my_notes.txt").read_text() == "keep me"
