"""Checkpoints: one directory per saved step, committed by a manifest written last.

    DIR/manifest.json              the commit point: plan digest, step, world size, and per rank
                                   the file name, its SHA-256 and its size
    DIR/step_00000004/rank_<r>.pt  a rank's state (`Runtime.state_dict` + step, rank, plan digest)
    DIR/step_00000004/rank_<r>.json  what the rank wrote (file, sha256, size, step); rank 0 gathers these

Every file is written to a temporary name in its own directory, fsynced and renamed, so a reader
sees a whole file or none. A save writes a step directory the manifest does not name (a save of the
step the manifest already commits, a rerun or a resume saved at once, writes `step_<k>.resaved`, and
the next one `step_<k>` again); all ranks meet at a barrier; then rank 0 writes the manifest
(temporary name, fsync, rename, fsync of DIR) and removes the other step directories. Until that
rename the previous manifest and its step directory stay as they were, byte for byte, so a crash,
a kill or a full disk mid-save loses the steps since the last complete checkpoint and nothing more.
Resuming checks the manifest against the plan, the world size and every file's size and hash before
any rank trains (`verify`), and each rank checks its file again while loading it (`load`), with
`torch.load(weights_only=True)`: a checkpoint holds tensors and plain data only, and the tensors
its stages have (names, shapes, dtypes).
For a multi-node run DIR must be a directory every node sees (rank 0 reads every rank's record).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dapple_ir.errors import DappleError
from dapple_ir.plan_dir import current_umask

MANIFEST = "manifest.json"
"""The commit point of a checkpoint directory."""
FORMAT = 1
"""Version of the manifest's layout."""
#: The mode of a file created under this process's umask, read once at import (before rank threads start).
_FILE_MODE = 0o666 & ~current_umask()
_STEP_DIR = re.compile(r"step_[0-9]{8,}(\.resaved)?")
#: The suffix of the second folder of a step: a save of the step the manifest commits writes there (`fresh_folder`).
_RESAVED = ".resaved"
_RANK_FILE = re.compile(r"rank_([0-9]+)\.pt")


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def step_folders(step: int) -> tuple[str, str]:
    """The two folders a step's files may be in: a save writes whichever the committed manifest does not name."""
    return step_dir(step), step_dir(step) + _RESAVED


def rank_file(rank: int) -> str:
    return f"rank_{rank}.pt"


@dataclass
class Manifest:
    """A checkpoint directory's manifest, checked (`read_manifest`)."""

    directory: Path
    step: int
    world_size: int
    plan_digest: str
    files: dict[int, tuple[str, str, int]]
    """rank -> (file relative to the checkpoint directory, sha256, size in bytes)."""

    @property
    def folder(self) -> str:
        """The step folder the files are in (that of the lowest rank; `_checked_path` holds every rank to it)."""
        return Path(self.files[min(self.files)][0]).parent.name if self.files else step_dir(self.step)


# ------------------------------------------------------------------------------ before training


def check_save_dir(directory: Path) -> None:
    """Refuse, before any rank trains, a `--save` directory that cannot be created or written."""
    if directory.exists() and not directory.is_dir():
        raise DappleError(f"--save {directory} is a file, not a directory; name a directory to hold the checkpoints")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise DappleError(
            f"cannot write checkpoints into --save {directory}: {exc.strerror or exc}; nothing was trained. "
            "Choose a directory this user can create and write to"
        ) from None


def check_save_owner(directory: Path, plan_digest: str, *, force: bool = False) -> None:
    """Refuse a `--save` directory whose committed checkpoint another plan wrote (the save would replace it),
    unless `force`; a checkpoint of this plan, an empty directory or a new one is fine."""
    if force or not (directory / MANIFEST).is_file():
        return
    try:
        manifest = read_manifest(directory)
    except DappleError as exc:
        raise DappleError(
            f"--save {directory} holds a manifest.json this plan did not write ({exc}); saving would replace it: "
            "choose another directory, or pass --force to replace it"
        ) from None
    if manifest.plan_digest == plan_digest:
        return
    raise DappleError(
        f"--save {directory} holds the committed checkpoint of another plan (step {manifest.step}, "
        f"{manifest.world_size} ranks, plan digest {manifest.plan_digest[:12]}; this plan's is {plan_digest[:12]}), "
        "which saving would replace; choose another directory, or pass --force to replace it"
    )


def read_manifest(directory: Path) -> Manifest:
    """The manifest of a checkpoint directory, or a `DappleError` naming what is missing or malformed."""
    if not directory.is_dir():
        raise DappleError(f"--resume {directory}: no such checkpoint directory")
    path = directory / MANIFEST
    if not path.is_file():
        raise DappleError(
            f"--resume {directory}: {path} is missing, so no checkpoint in it is complete (a save that did not "
            "finish, or not a checkpoint directory written by `dapple run --save`)"
        )
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise DappleError(f"checkpoint manifest {path} is not JSON ({exc}); was it edited?") from None
    except RecursionError:
        raise DappleError(f"checkpoint manifest {path} nests too deeply to be a manifest; was it edited?") from None
    if not isinstance(data, dict):
        raise DappleError(
            f"checkpoint manifest {path} holds a JSON {type(data).__name__}, not an object; was it edited?"
        )
    if data.get("format") != FORMAT:
        raise DappleError(f"checkpoint manifest {path} has format {data.get('format')!r}, not {FORMAT}")
    fields = _ManifestFields(path, data)
    ranks = data.get("ranks")
    if not isinstance(ranks, list) or not all(isinstance(e, dict) for e in ranks):
        raise fields.bad("ranks", "a list of objects (rank, file, sha256, size)")
    files = {}
    for i, entry in enumerate(ranks):
        one = _ManifestFields(path, entry, f"ranks[{i}].")
        files[one.whole("rank")] = (one.text("file"), one.text("sha256"), one.whole("size"))
    return Manifest(directory, fields.whole("step"), fields.whole("world_size"), fields.text("plan_digest"), files)


@dataclass
class _ManifestFields:
    """Reads the fields of one JSON object of a manifest, each checked for its type and range."""

    path: Path
    data: dict[str, Any]
    prefix: str = ""

    def bad(self, key: str, want: str) -> DappleError:
        shown = repr(self.data.get(key))
        shown = shown if len(shown) <= 40 else shown[:40] + "..."
        return DappleError(
            f"checkpoint manifest {self.path}: field {self.prefix}{key} must be {want}, not {shown}; was it edited?"
        )

    def whole(self, key: str) -> int:
        value = self.data.get(key)
        if type(value) is not int or not 0 <= value < 2**63:
            raise self.bad(key, "a whole number from 0 to 2**63 - 1")
        return value

    def text(self, key: str) -> str:
        value = self.data.get(key)
        if not isinstance(value, str):
            raise self.bad(key, "a string")
        return value


def verify(directory: Path, plan_digest: str, world_size: int) -> Manifest:
    """Check a checkpoint against the plan before anything trains: digest, ranks, and every file's bytes."""
    manifest = read_manifest(directory)
    where = directory / MANIFEST
    if manifest.plan_digest != plan_digest:
        raise DappleError(
            f"--resume {directory}: the checkpoint was saved by a different plan (digest {manifest.plan_digest[:12]} "
            f"in {where}, this plan's is {plan_digest[:12]}); resume with the same plan"
        )
    if manifest.world_size != world_size or sorted(manifest.files) != list(range(world_size)):
        raise DappleError(
            f"--resume {directory}: {where} lists ranks {sorted(manifest.files)} of a world of {manifest.world_size}, "
            f"but the plan has {world_size} ranks"
        )
    folder = directory / manifest.folder
    for found in sorted(folder.glob("rank_*.pt")) if folder.is_dir() else []:
        match = _RANK_FILE.fullmatch(found.name)
        if match is None or int(match.group(1)) >= world_size:
            raise DappleError(
                f"--resume {directory}: {found} is not part of the checkpoint ({where} lists ranks 0 to "
                f"{world_size - 1}); remove it or resume from a clean copy"
            )
    for rank in range(world_size):
        path = _checked_path(manifest, rank)
        _check_bytes(manifest, rank, path, path.read_bytes())
        # The file's own record of step, rank and plan, read without loading its tensors (mmap).
        _check_recorded(_load_state(path, path, mmap=True), path, manifest, rank)
    return manifest


def _checked_path(manifest: Manifest, rank: int) -> Path:
    name = manifest.files[rank][0]
    path = manifest.directory / name
    folder = manifest.folder
    if (
        folder not in step_folders(manifest.step)
        or path.parent != manifest.directory / folder
        or path.name != rank_file(rank)
    ):
        raise DappleError(f"--resume: {manifest.directory / MANIFEST} names {name} for rank {rank}; was it edited?")
    if not path.is_file():
        raise DappleError(f"--resume: checkpoint file {path} of rank {rank} is missing")
    return path


def _check_bytes(manifest: Manifest, rank: int, path: Path, data: bytes) -> None:
    """The file's size and SHA-256 are the manifest's."""
    _, sha256, size = manifest.files[rank]
    if len(data) != size:
        raise DappleError(
            f"--resume: checkpoint file {path} holds {len(data)} bytes, but the manifest recorded {size}: it is "
            f"{'empty' if not data else 'truncated' if len(data) < size else 'longer than written'}"
        )
    if hashlib.sha256(data).hexdigest() != sha256:
        raise DappleError(
            f"--resume: checkpoint file {path} does not hash to the SHA-256 in the manifest: its bytes changed since "
            f"it was saved{_recorded_step_note(path, manifest.step)}"
        )


def _recorded_step_note(path: Path, step: int) -> str:
    """Why the hash differs, when the file is a whole checkpoint of another step."""
    try:
        recorded = _load_state(path, path, mmap=True).get("step")
    except DappleError:
        return " (corrupted)"
    if recorded != step:
        return f" (it holds step {recorded}, the manifest step {step}: a rank file from another checkpoint)"
    return " (corrupted or replaced)"


def _check_recorded(state: dict[str, Any], path: Path, manifest: Manifest, rank: int) -> None:
    """The file records the step, rank and plan the manifest names (a file copied from elsewhere does not)."""
    for key, expected in (("step", manifest.step), ("rank", rank), ("plan_digest", manifest.plan_digest)):
        if state.get(key) != expected:
            raise DappleError(
                f"--resume: checkpoint file {path} records {key} {state.get(key)!r}, but the manifest and plan "
                f"expect {expected!r}: a file from another step, rank or plan"
            )


# ------------------------------------------------------------------------------ load and save


def load(directory: Path, rank: int, plan_digest: str, expected: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rank `rank`'s saved state, checked again (size, hash, step, rank, plan) as it is read, and against
    `expected` (the rank's own `Runtime.state_dict()`): the same stages, each tensor's name, shape and dtype."""
    manifest = read_manifest(directory)
    if rank not in manifest.files:
        raise DappleError(f"--resume: {directory / MANIFEST} has no file for rank {rank}")
    if manifest.plan_digest != plan_digest:
        raise DappleError(f"--resume {directory}: the checkpoint was saved by a different plan")
    path = _checked_path(manifest, rank)
    data = path.read_bytes()
    _check_bytes(manifest, rank, path, data)
    state = _load_state(io.BytesIO(data), path)
    _check_recorded(state, path, manifest, rank)
    if expected is not None:
        _check_structure(state, expected, path)
    return state


def _check_structure(state: dict[str, Any], expected: dict[str, Any], path: Path) -> None:
    """The file holds the state this rank's stages have, tensor for tensor (a forged or foreign file of the
    right step, rank and plan digest would otherwise fail inside torch, as a KeyError or a state-dict error)."""
    stages, want = state.get("stages"), expected["stages"]
    if not isinstance(stages, dict) or sorted(stages) != sorted(want):
        shown = sorted(stages) if isinstance(stages, dict) else type(stages).__name__
        raise DappleError(
            f"--resume: checkpoint file {path} holds stages {shown}, but this rank runs {sorted(want)}: it was saved "
            "by another plan or forged"
        )
    for stage, tensors in want.items():
        found = stages[stage]
        for name, tensor in tensors.items():
            got = found.get(name) if isinstance(found, dict) else None
            if not isinstance(got, torch.Tensor) or (got.shape, got.dtype) != (tensor.shape, tensor.dtype):
                what = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else repr(got)[:40]
                raise DappleError(
                    f"--resume: checkpoint file {path} holds {what} for {stage}/{name}, where this rank's stage has "
                    f"a {tuple(tensor.shape)} {tensor.dtype} tensor: it was saved by another plan or forged"
                )
        extra = sorted(set(found) - set(tensors)) if isinstance(found, dict) else []
        if extra:
            raise DappleError(
                f"--resume: checkpoint file {path} holds {stage}/{extra[0]}, which this rank's stage lacks"
            )
    if not isinstance(state.get("optimizer"), dict):
        raise DappleError(f"--resume: checkpoint file {path} holds no optimizer state (a dict): forged or foreign")


def _load_state(source: io.BytesIO | Path, path: Path, *, mmap: bool = False) -> dict[str, Any]:
    try:
        state = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise DappleError(
            f"--resume: checkpoint file {path} holds objects a checkpoint never contains (only tensors and plain "
            f"data are loaded; refused: {str(exc).splitlines()[0]})"
        ) from None
    except (EOFError, RuntimeError, ValueError, OSError) as exc:
        raise DappleError(f"--resume: checkpoint file {path} cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise DappleError(f"--resume: checkpoint file {path} holds a {type(state).__name__}, not a rank's state")
    return state


def save(
    state: dict[str, Any], directory: Path, *, rank: int, world_size: int, plan_digest: str, barrier: Callable[[], None]
) -> None:
    """Write `state` (a rank's, with its `step`) into a step folder the committed manifest does not name; rank 0
    commits after `barrier`."""
    step = int(state["step"])
    name = fresh_folder(directory, step)
    folder = directory / name
    payload = {**state, "rank": rank, "plan_digest": plan_digest}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    target = folder / rank_file(rank)
    record = {"file": f"{name}/{rank_file(rank)}", "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    with _disk_errors(directory, target):
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(target, data)
        write_atomically(folder / f"rank_{rank}.json", json.dumps({**record, "step": step}).encode())
    barrier()
    if rank == 0:
        _commit(directory, name, step, world_size, plan_digest)


def fresh_folder(directory: Path, step: int) -> str:
    """The folder a save of `step` writes into: never the one the committed manifest names, so a crash before the
    new manifest commits leaves the committed files as they were, even when both are of the same step (a save
    rerun, or a resume saved at the step it resumed from). Every rank reads the manifest before the barrier of
    its save, and rank 0 replaces it only after, so all ranks choose the same folder."""
    plain, resaved = step_folders(step)
    try:
        committed = read_manifest(directory).folder
    except DappleError:
        return plain
    return resaved if committed == plain else plain


def _commit(directory: Path, name: str, step: int, world_size: int, plan_digest: str) -> None:
    folder = directory / name
    ranks = []
    for r in range(world_size):
        record_path = folder / f"rank_{r}.json"
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError) as exc:
            raise DappleError(
                f"cannot commit checkpoint step {step}: rank {r}'s record {record_path} is unreadable ({exc}); "
                "--save must name a directory every rank (every node) can see"
            ) from None
        ranks.append({"rank": r, "file": record["file"], "sha256": record["sha256"], "size": record["size"]})
    manifest = {"format": FORMAT, "plan_digest": plan_digest, "step": step, "world_size": world_size, "ranks": ranks}
    path = directory / MANIFEST
    with _disk_errors(directory, path):
        write_atomically(path, (json.dumps(manifest, indent=1) + "\n").encode())
    for old in directory.iterdir():
        if _STEP_DIR.fullmatch(old.name) and old.name != name and old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)


def write_atomically(path: Path, data: bytes) -> None:
    """`path` holds `data` whole or keeps what it held: temporary file beside it, fsync, rename, fsync the folder."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp makes the file private (0600); a checkpoint gets the usual mode, as any file written.
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


@contextmanager
def _disk_errors(directory: Path, path: Path) -> Iterator[None]:
    """Turns an `OSError` while saving into a `DappleError` naming the file and the checkpoint that survives."""
    try:
        yield
    except OSError as exc:
        full = " (the disk is full)" if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else ""
        try:
            kept = f"the last complete checkpoint, step {read_manifest(directory).step}, is intact"
        except DappleError:
            kept = "no earlier checkpoint is complete"
        raise DappleError(
            f"cannot write checkpoint file {path}: {exc.strerror or exc}{full}; training stopped here and {kept} "
            f"in {directory} (resume from it with --resume {directory})"
        ) from None
