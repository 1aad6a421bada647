"""Checkpoints lose nothing and accept nothing wrong (issue 18, item 2).

Saves are atomic per step and committed by a manifest; `--save-every N` bounds what a fault loses;
a resumed run continues bit for bit as the uninterrupted run (the oracle: that same plan trained
without a stop); every mismatch of a checkpoint is refused before any rank trains, naming the file.
Runs use the threads transport (one process, fast), except one torchrun run whose worker is
SIGKILLed. The full disk is simulated by an `os.fsync` that reports ENOSPC after half the file
reached the disk, the way a delayed-allocation filesystem reports a full disk, so the real write
path (temporary file, cleanup, error) runs unchanged; a tmpfs needs root, and RLIMIT_FSIZE would
also stop the run's other files and raise EFBIG, not ENOSPC.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dapple_ir.backends.torch import checkpoint
from dapple_ir.backends.torch.launch import RunResult, run
from dapple_ir.backends.torch.runtime import Runtime
from dapple_ir.backends.torch.worker import RunOptions
from dapple_ir.errors import DappleError, RuntimeFailure
from tests.test_runtime import MLP, make_plan

OPTIONS: dict[str, Any] = {"transport": "threads", "optimizer": "adam", "lr": 1e-2, "timeout": 30.0}


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_plan(tmp_path_factory.mktemp("ckpt") / "plan", MLP, stages=2, kind="1f1b")


@pytest.fixture(scope="module")
def whole(plan: Path) -> RunResult:
    """The reference: five steps without a stop."""
    return run(plan, steps=5, **OPTIONS)


@pytest.fixture
def steps_run(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps every rank trains (to prove a refusal came before any training)."""
    seen: list[int] = []
    original = Runtime.run_step

    def counting(self: Runtime, train_step: Any) -> None:
        seen.append(self.step)
        original(self, train_step)

    monkeypatch.setattr(Runtime, "run_step", counting)
    return seen


def _fault_at(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Rank 1 dies at the start of `step` (as a killed worker would: no save at the end)."""
    original = Runtime.run_step

    def failing(self: Runtime, train_step: Any) -> None:
        if self.rank == 1 and self.step == step:
            raise DappleError(f"rank 1: injected fault at step {step}")
        original(self, train_step)

    monkeypatch.setattr(Runtime, "run_step", failing)


def _same_params(a: RunResult, b: RunResult) -> None:
    assert a.params.keys() == b.params.keys()
    for rank in a.params:
        assert a.params[rank].keys() == b.params[rank].keys()
        for name, tensor in a.params[rank].items():
            assert torch.equal(tensor, b.params[rank][name]), f"rank {rank} {name} differs"


def _manifest(directory: Path) -> dict[str, Any]:
    return json.loads((directory / checkpoint.MANIFEST).read_text())  # type: ignore[no-any-return]


def _rank_file(directory: Path, rank: int) -> Path:
    return directory / checkpoint.step_dir(_manifest(directory)["step"]) / f"rank_{rank}.pt"


@pytest.fixture
def saved(plan: Path, tmp_path: Path) -> Path:
    """A checkpoint of step 2."""
    run(plan, steps=2, save=tmp_path / "ckpt", **OPTIONS)
    return tmp_path / "ckpt"


# ------------------------------------------------------------------------------ exactness


def test_save_every_then_fault_then_resume_equals_the_uninterrupted_run(
    plan: Path, whole: RunResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "ckpt"
    with monkeypatch.context() as patch:
        _fault_at(patch, 3)
        with pytest.raises(RuntimeFailure, match=r"injected fault at step 3"):
            run(plan, steps=5, save=ckpt, save_every=2, **OPTIONS)
    # The periodic save of step 2 survived the fault; steps 0-1 and 2 are all that is lost at most.
    assert _manifest(ckpt)["step"] == 2
    assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json", "step_00000002"]
    resumed = run(plan, steps=3, resume=ckpt, **OPTIONS)
    assert resumed.first_step == 2
    assert resumed.losses == whole.losses[2:]
    _same_params(resumed, whole)


def test_save_every_keeps_only_the_latest_complete_step(plan: Path, whole: RunResult, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    finished = run(plan, steps=5, save=ckpt, save_every=2, **OPTIONS)
    assert finished.losses == whole.losses
    manifest = _manifest(ckpt)
    assert manifest["step"] == 5  # saves at 2 and 4, and after the last step
    assert manifest["world_size"] == 2
    assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json", "step_00000005"]
    for entry in manifest["ranks"]:
        data = (ckpt / entry["file"]).read_bytes()
        assert len(data) == entry["size"]
    assert not list(ckpt.rglob("*.tmp"))


# ------------------------------------------------------------------------------ refusals


def _refused(plan: Path, ckpt: Path, pattern: str, steps_run: list[int]) -> str:
    with pytest.raises(DappleError, match=pattern) as info:
        run(plan, steps=1, resume=ckpt, **OPTIONS)
    assert steps_run == [], "a bad checkpoint must be refused before any step"
    message = str(info.value)
    assert "Traceback" not in message and "\n" not in message
    return message


def test_missing_manifest(plan: Path, saved: Path, steps_run: list[int]) -> None:
    (saved / checkpoint.MANIFEST).unlink()
    _refused(plan, saved, r"manifest\.json is missing, so no checkpoint in it is complete", steps_run)


def test_missing_rank_file(plan: Path, saved: Path, steps_run: list[int]) -> None:
    _rank_file(saved, 1).unlink()
    _refused(plan, saved, r"checkpoint file .*step_00000002/rank_1\.pt of rank 1 is missing", steps_run)


def test_extra_rank_file(plan: Path, saved: Path, steps_run: list[int]) -> None:
    shutil.copy(_rank_file(saved, 0), _rank_file(saved, 0).with_name("rank_2.pt"))
    _refused(plan, saved, r"rank_2\.pt is not part of the checkpoint", steps_run)


def test_200_flipped_bytes(plan: Path, saved: Path, steps_run: list[int]) -> None:
    path = _rank_file(saved, 0)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + 200):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    _refused(plan, saved, r"rank_0\.pt does not hash to the SHA-256 in the manifest", steps_run)


@pytest.mark.parametrize("keep", [0, 0.5], ids=["empty", "truncated"])
def test_empty_or_truncated_file(plan: Path, saved: Path, steps_run: list[int], keep: float) -> None:
    path = _rank_file(saved, 1)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    message = _refused(plan, saved, r"rank_1\.pt holds [0-9]+ bytes, but the manifest recorded", steps_run)
    assert ("empty" if keep == 0 else "truncated") in message
    assert "EOFError" not in message


def test_rank_file_from_another_step(plan: Path, saved: Path, tmp_path: Path, steps_run: list[int]) -> None:
    older = tmp_path / "older"
    run(plan, steps=1, save=older, **OPTIONS)
    shutil.copy(_rank_file(older, 1), _rank_file(saved, 1))
    steps_run.clear()
    _refused(plan, saved, r"rank_1\.pt does not hash .* \(it holds step 1, the manifest step 2", steps_run)


def test_rank_file_from_another_step_with_a_matching_manifest_entry(
    plan: Path, saved: Path, tmp_path: Path, steps_run: list[int]
) -> None:
    # Even a manifest edited to vouch for the foreign file is caught: the file records its own step.
    older = tmp_path / "older"
    run(plan, steps=1, save=older, **OPTIONS)
    target = _rank_file(saved, 1)
    shutil.copy(_rank_file(older, 1), target)
    manifest = _manifest(saved)
    data = target.read_bytes()
    manifest["ranks"][1] |= {"sha256": checkpoint.hashlib.sha256(data).hexdigest(), "size": len(data)}
    (saved / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    steps_run.clear()
    _refused(plan, saved, r"rank_1\.pt records step 1, but the manifest and plan expect 2", steps_run)


class Gadget:
    """Not something a checkpoint holds: unpickling it would run code of our choosing."""


def test_unexpected_pickle_is_refused(plan: Path, saved: Path, steps_run: list[int]) -> None:
    target = _rank_file(saved, 0)
    torch.save({"step": 2, "rank": 0, "gadget": Gadget()}, target)
    manifest = _manifest(saved)
    data = target.read_bytes()
    manifest["ranks"][0] |= {"sha256": checkpoint.hashlib.sha256(data).hexdigest(), "size": len(data)}
    (saved / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DappleError, match=r"rank_0\.pt holds objects a checkpoint never contains"):
        run(plan, steps=1, resume=saved, **OPTIONS)


def test_a_checkpoint_of_another_plan(tmp_path: Path, saved: Path, steps_run: list[int]) -> None:
    other = make_plan(tmp_path / "other", MLP, stages=2, kind="gpipe")
    steps_run.clear()
    _refused(other, saved, r"saved by a different plan .* resume with the same plan", steps_run)


def test_empty_bytes_never_give_a_bare_eof_error() -> None:
    with pytest.raises(DappleError, match=r"cannot be read \(EOFError"):
        checkpoint._load_state(io.BytesIO(b""), Path("rank_0.pt"))


# ------------------------------------------------------------------------------ --save


def test_unwritable_save_is_refused_before_training(plan: Path, tmp_path: Path, steps_run: list[int]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(DappleError, match=r"cannot write checkpoints into --save .*a-file/ckpt: .*nothing was trained"):
        run(plan, steps=1, save=blocker / "ckpt", **OPTIONS)
    with pytest.raises(DappleError, match=r"--save .*a-file is a file, not a directory"):
        run(plan, steps=1, save=blocker, **OPTIONS)
    assert steps_run == []


@pytest.fixture
def full_disk_at(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """`os.fsync` of rank 1's file of step 4 finds the disk full after half the bytes were written."""
    real_fsync = os.fsync
    hits: list[str] = []

    def fsync(fd: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if "step_00000004" in name and Path(name).name.startswith(".rank_1.pt."):
            size = os.fstat(fd).st_size
            os.ftruncate(fd, size // 2)
            hits.append(name)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    yield hits


def test_full_disk_keeps_the_previous_checkpoint(
    plan: Path, whole: RunResult, tmp_path: Path, full_disk_at: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "ckpt"
    with pytest.raises(
        RuntimeFailure,
        match=r"cannot write checkpoint file .*step_00000004/rank_1\.pt: No space left on device \(the disk is full\); "
        r"training stopped here and the last complete checkpoint, step 2, is intact",
    ):
        run(plan, steps=5, save=ckpt, save_every=2, **OPTIONS)
    assert full_disk_at, "the simulated full disk was never reached"
    monkeypatch.undo()
    assert _manifest(ckpt)["step"] == 2
    assert not list(ckpt.rglob("*.tmp")) and not list(ckpt.rglob(".rank_*"))  # no partial file left
    resumed = run(plan, steps=3, resume=ckpt, **OPTIONS)
    _same_params(resumed, whole)


# ------------------------------------------------------------------------------ options


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"save_every": 0, "save": "ckpt"}, r"--save-every must be at least 1 step, not 0"),
        ({"save_every": 2}, r"--save-every needs --save DIR"),
        ({"steps": 0}, r"steps must be at least 1"),
        ({"timeout": float("nan")}, r"timeout must be a positive number of seconds"),
    ],
)
def test_run_options_are_checked(change: dict[str, Any], pattern: str) -> None:
    base: dict[str, Any] = {"steps": 1, "optimizer": "sgd", "lr": 0.1, "timeout": 5.0, "run_dir": "run"}
    with pytest.raises(DappleError, match=pattern):
        RunOptions(**(base | change))


def test_each_rank_checks_its_file_again_while_loading(saved: Path) -> None:
    # What the launcher verified may change before a rank reads it: the rank checks size, hash and record again.
    digest = checkpoint.read_manifest(saved).plan_digest
    assert checkpoint.load(saved, 0, digest)["step"] == 2
    with pytest.raises(DappleError, match=r"saved by a different plan"):
        checkpoint.load(saved, 0, "0" * 64)
    path = _rank_file(saved, 0)
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(DappleError, match=r"rank_0\.pt does not hash to the SHA-256"):
        checkpoint.load(saved, 0, digest)


#: A model whose data function SIGKILLs the torchrun worker of rank 1 when it fetches step
#: DAPPLE_TEST_KILL_STEP: a fault no code of ours sees coming (no save at the end, no error report).
KILLABLE = """
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn


def factory():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, (torch.randn(4, 8),), F.mse_loss, (torch.randn(4, 4),)


def dapple_data(step, global_batch, seed):
    if os.environ.get("RANK") == "1" and str(step) == os.environ.get("DAPPLE_TEST_KILL_STEP"):
        os.kill(os.getpid(), signal.SIGKILL)
    g = torch.Generator().manual_seed(seed + 17 * step)
    return (torch.randn(global_batch, 8, generator=g),), (torch.randn(global_batch, 4, generator=g),)
"""


@pytest.mark.slow
def test_torchrun_kill_9_then_resume_equals_the_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "killable.py"
    model.write_text(KILLABLE)
    plan = make_plan(tmp_path / "plan", f"{model}:factory", stages=2, kind="1f1b")
    reference = run(plan, steps=5, **OPTIONS)  # threads: no RANK variable, nothing is killed
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("DAPPLE_TEST_KILL_STEP", "3")
    with pytest.raises(RuntimeFailure, match=r"rank 1 was killed by signal 9"):
        run(plan, steps=5, save=ckpt, save_every=2, **(OPTIONS | {"transport": "torchrun"}))
    monkeypatch.delenv("DAPPLE_TEST_KILL_STEP")
    assert _manifest(ckpt)["step"] == 2  # the periodic save before the kill, committed
    resumed = run(plan, steps=3, resume=ckpt, **OPTIONS)  # rank files load the same way in either transport
    assert resumed.first_step == 2
    assert resumed.losses == reference.losses[2:]
    _same_params(resumed, reference)


def test_worker_flags_carry_every_option_to_the_torchrun_workers(tmp_path: Path) -> None:
    from dapple_ir.backends.torch.worker import options_from_args, worker_flags, worker_parser

    options = RunOptions(
        steps=7,
        optimizer="adamw",
        lr=3e-4,
        timeout=12.5,
        run_dir=str(tmp_path / "run"),
        save=str(tmp_path / "ckpt"),
        resume=str(tmp_path / "old"),
        device="cpu",
        check=True,
        save_every=3,
    )
    # Each flag away from its default too: the switches write a flag only then.
    switched = dataclasses.replace(options, reuse_buffers=False, meter_every_step=True, pin_cores=False)
    for each in (options, switched):
        args = worker_parser().parse_args(["plan", *worker_flags(each)])
        assert options_from_args(args, args.optimizer, args.lr, Path(args.run_dir)) == each


# ------------------------------------------------------------------------------ a save of the committed step (issue 47)

_DIGEST = "d" * 64
#: Run as `python -c` with the checkpoint directory: rank 0 saves step 2 again, then is killed with SIGKILL at the
#: barrier, as it is when rank 1 dies while it starts to write (the run ends there, nothing commits).
_RESAVE_THEN_KILL = f"""
import os, signal, sys
from pathlib import Path
import torch
from dapple_ir.backends.torch import checkpoint
state = {{"step": 2, "stages": {{"s0": {{"w": torch.full((4,), 7.0)}}}}, "optimizer": {{}}}}
checkpoint.save(state, Path(sys.argv[1]), rank=0, world_size=2, plan_digest="{_DIGEST}",
                barrier=lambda: os.kill(os.getpid(), signal.SIGKILL))
"""


def _commit_step_2(directory: Path, value: float) -> None:
    for rank in (1, 0):  # rank 0 last: it commits
        state = {"step": 2, "stages": {"s0": {"w": torch.full((4,), value)}}, "optimizer": {}}
        checkpoint.save(state, directory, rank=rank, world_size=2, plan_digest=_DIGEST, barrier=lambda: None)


def test_a_kill_while_saving_the_committed_step_again_keeps_the_checkpoint(tmp_path: Path) -> None:
    """Before: the re-save overwrote step_00000002/rank_0.pt in place, and `--resume` refused the only checkpoint
    (`rank_0.pt does not hash to the SHA-256 in the manifest`)."""
    ckpt = tmp_path / "ckpt"
    _commit_step_2(ckpt, 1.0)
    committed = {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    killed = subprocess.run([sys.executable, "-c", _RESAVE_THEN_KILL, str(ckpt)], capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    for name, data in committed.items():
        assert (ckpt / name).read_bytes() == data, f"{name} changed before a new manifest committed"
    assert (ckpt / "step_00000002.resaved" / "rank_0.pt").is_file()  # it did write, beside the committed files
    checkpoint.verify(ckpt, _DIGEST, 2)
    assert torch.equal(checkpoint.load(ckpt, 0, _DIGEST)["stages"]["s0"]["w"], torch.ones(4))


def test_saving_the_committed_step_again_alternates_folders(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    for value, folder in ((1.0, "step_00000002"), (2.0, "step_00000002.resaved"), (3.0, "step_00000002")):
        _commit_step_2(ckpt, value)
        assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json", folder]
        assert torch.equal(checkpoint.load(ckpt, 1, _DIGEST)["stages"]["s0"]["w"], torch.full((4,), value))


def test_rerunning_the_same_save_then_resuming_equals_the_uninterrupted_run(
    plan: Path, whole: RunResult, saved: Path
) -> None:
    again = run(plan, steps=2, save=saved, **OPTIONS)
    assert again.losses == whole.losses[:2]
    assert _manifest(saved)["ranks"][0]["file"] == "step_00000002.resaved/rank_0.pt"
    resumed = run(plan, steps=3, resume=saved, **OPTIONS)
    assert resumed.losses == whole.losses[2:]
    _same_params(resumed, whole)


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (
            lambda t: t.replace('"step": 2', '"step": 1e999'),
            "field step must be a whole number from 0 to 2**63 - 1, not inf",
        ),
        (lambda t: t.replace('"step": 2', '"step": 2.5'), "field step must be a whole number"),
        (lambda t: t.replace('"size": ', '"size": -'), "field ranks[0].size must be a whole number"),
        (lambda t: t.replace('"world_size": 2', '"world_size": true'), "field world_size must be a whole number"),
        (lambda t: "[" * 100_000 + "]" * 100_000, "nests too deeply to be a manifest"),
        (lambda t: '{"format": 1, "ranks": 3}', "field ranks must be a list of objects"),
        (lambda t: "\xff\xfe", "is not JSON"),
        (lambda t: "7", "holds a JSON int, not an object"),
    ],
    ids=["step-1e999", "step-2.5", "negative-size", "bool", "deep", "ranks-int", "binary", "number"],
)
def test_a_damaged_manifest_is_located(tmp_path: Path, edit: Any, needle: str) -> None:
    """Before: `"step": 1e999` gave OverflowError and 100k-deep JSON a RecursionError, both internal errors."""
    ckpt = tmp_path / "ckpt"
    _commit_step_2(ckpt, 1.0)
    path = ckpt / checkpoint.MANIFEST
    path.write_text(edit(path.read_text()), encoding="latin-1")
    with pytest.raises(DappleError) as info:
        checkpoint.verify(ckpt, _DIGEST, 2)
    message = str(info.value)
    assert needle in message and str(path) in message and "\n" not in message


@pytest.mark.parametrize(
    ("stages", "needle"),
    [
        (None, "holds stages NoneType, but this rank runs ['s0']"),
        ({"s9": {"w": torch.zeros(4)}}, "holds stages ['s9'], but this rank runs ['s0']"),
        ({"s0": {"w": torch.zeros(3)}}, "holds (3,) torch.float32 for s0/w, where this rank's stage has a (4,)"),
        ({"s0": {}}, "holds None for s0/w"),
        ({"s0": {"w": torch.zeros(4), "b": torch.zeros(1)}}, "holds s0/b, which this rank's stage lacks"),
    ],
    ids=["no-stages", "other-stage", "other-shape", "missing-tensor", "extra-tensor"],
)
def test_a_forged_rank_file_of_another_structure_is_named(tmp_path: Path, stages: Any, needle: str) -> None:
    """A rank file of the right step, rank and plan digest, manifest and hash matching, but other tensors. Before:
    `KeyError: 'stages'` or torch's state-dict error from inside the runtime."""
    ckpt = tmp_path / "ckpt"
    for rank in (1, 0):
        state = {"step": 2, "stages": stages, "optimizer": {}}
        checkpoint.save(state, ckpt, rank=rank, world_size=2, plan_digest=_DIGEST, barrier=lambda: None)
    expected = {"stages": {"s0": {"w": torch.ones(4)}}, "optimizer": {}}
    with pytest.raises(DappleError) as info:
        checkpoint.load(ckpt, 0, _DIGEST, expected=expected)
    assert needle in str(info.value) and "rank_0.pt" in str(info.value)


def test_a_forged_rank_file_is_named_when_a_run_resumes(plan: Path, saved: Path) -> None:
    """The runtime path of the case above: the rank loading it stops the run with the file named."""
    target = _rank_file(saved, 1)
    forged = torch.load(target, weights_only=True)
    forged["stages"] = {name: {} for name in forged["stages"]}
    torch.save(forged, target)
    manifest = _manifest(saved)
    data = target.read_bytes()
    manifest["ranks"][1] |= {"sha256": checkpoint.hashlib.sha256(data).hexdigest(), "size": len(data)}
    (saved / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DappleError, match=r"rank_1\.pt holds None for s\d+/.*: it was saved by another plan or forged"):
        run(plan, steps=1, resume=saved, **OPTIONS)


def test_saving_over_another_plans_checkpoint_needs_force(
    tmp_path: Path, saved: Path, steps_run: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: `--save` into a directory holding another plan's committed checkpoint replaced it without a word."""
    from dapple_ir.cli import main

    other = make_plan(tmp_path / "other", MLP, stages=2, kind="gpipe")
    before = _manifest(saved)
    argv = ["run", str(other), "--steps", "1", "--transport", "threads", "--save", str(saved)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--save {saved} holds the committed checkpoint of another plan (step 2, 2 ranks, plan digest" in err
    assert "--force" in err and steps_run == [] and _manifest(saved) == before
    assert main([*argv, "--force"]) == 0
    assert _manifest(saved)["plan_digest"] != before["plan_digest"] and _manifest(saved)["step"] == 1
