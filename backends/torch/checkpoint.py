"""Checkpoints: one directory per saved step, committed by a manifest written last.

    DIR/manifest.json              the commit point: plan digest, step, world size, and per rank
                                   the file name, its SHA-256 and its size
    DIR/step_00000004/rank_<r>.pt  a rank's state (`Runtime.state_dict` + step, rank, plan digest)
    DIR/step_00000004/rank_<r>.json  what the rank wrote (file, sha256, size, step); rank 0 gathers these

Every file is written to a temporary name in its own directory, fsynced and renamed, so a reader
sees a whole file or none. A save writes a new step directory; all ranks meet at a barrier; then
rank 0 writes the manifest (temporary name, fsync, rename, fsync of DIR) and removes older step
directories. Until that rename the previous manifest and its step directory stay as they were, so
a crash or a full disk mid-save loses the steps since the last complete checkpoint and nothing
more. Resuming checks the manifest against the plan, the world size and every file's size and
hash before any rank trains (`verify`), and each rank checks its file again while loading it
(`load`), with `torch.load(weights_only=True)`: a checkpoint holds tensors and plain data only.
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
_STEP_DIR = re.compile(r"step_[0-9]{8}")
_RANK_FILE = re.compile(r"rank_([0-9]+)\.pt")


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


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
        data = json.loads(path.read_text())
        files = {int(e["rank"]): (str(e["file"]), str(e["sha256"]), int(e["size"])) for e in data["ranks"]}
        manifest = Manifest(directory, int(data["step"]), int(data["world_size"]), str(data["plan_digest"]), files)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise DappleError(
            f"checkpoint manifest {path} is malformed ({type(exc).__name__}: {exc}); was it edited?"
        ) from None
    if data.get("format") != FORMAT:
        raise DappleError(f"checkpoint manifest {path} has format {data.get('format')!r}, not {FORMAT}")
    return manifest


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
    folder = directory / step_dir(manifest.step)
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
    if path.parent != manifest.directory / step_dir(manifest.step) or path.name != rank_file(rank):
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


def load(directory: Path, rank: int, plan_digest: str) -> dict[str, Any]:
    """Rank `rank`'s saved state, checked again (size, hash, step, rank, plan) as it is read."""
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
    return state


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
    """Write `state` (a rank's, with its `step`) into a new step directory; rank 0 commits after `barrier`."""
    step = int(state["step"])
    folder = directory / step_dir(step)
    payload = {**state, "rank": rank, "plan_digest": plan_digest}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    target = folder / rank_file(rank)
    name, sha256 = f"{step_dir(step)}/{rank_file(rank)}", hashlib.sha256(data).hexdigest()
    record = {"file": name, "sha256": sha256, "size": len(data), "step": step}
    with _disk_errors(directory, target):
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(target, data)
        write_atomically(folder / f"rank_{rank}.json", json.dumps(record).encode())
    barrier()
    if rank == 0:
        _commit(directory, step, world_size, plan_digest)


def _commit(directory: Path, step: int, world_size: int, plan_digest: str) -> None:
    folder = directory / step_dir(step)
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
        if old.is_dir() and _STEP_DIR.fullmatch(old.name) and old.name != folder.name:
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
