"""The plan directory: its file names, writing it atomically, loading it back, and its digest.

A plan directory holds `plan.dapple` (the lowered IR, the source of truth), `plan.json` (what the
runtime needs beside it, and the IR's SHA-256), `report.txt` (why this plan won), for a runnable
plan one `rank_<r>.py` per rank, and what `simulate` and `run` add later (timelines, pictures).
The api writes it, the torch backend and the simulator read it; nobody else spells these names.

Nothing in a plan is executable or unpickled: the JSON and the IR text are parsed, and the rank
files are run only when they are byte-for-byte what the backend's codegen writes for the IR.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapple_ir.errors import DappleError
from dapple_ir.ir import Module
from dapple_ir.ir.parser import parse_module, read_ir_file
from dapple_ir.ir.printer import print_module

PLAN_JSON = "plan.json"
"""What the runtime needs beside the IR (spec, seed, optimizer, ...) and the IR's digest."""
PLAN_IR = "plan.dapple"
"""The lowered IR in its text form."""
REPORT = "report.txt"
"""Why this plan won: the planner's explanation."""
TIMELINE = "timeline.json"
"""The simulated timeline (Chrome trace), written by `dapple simulate`."""
TIMELINE_PICTURE = "timeline.png"
"""The simulated timeline drawn, written by `dapple simulate`."""
TIMELINE_MEASURED = "timeline_measured.json"
"""The timeline `dapple run` measured, in the simulator's trace format."""
TIMELINE_COMPARE = "timeline-compare.png"
"""Prediction over measurement, written by `dapple simulate --compare`."""


def rank_file(rank: int) -> str:
    """The generated program of one rank."""
    return f"rank_{rank}.py"


_RANK_FILE = re.compile(r"rank_[0-9]+\.py")


#: Where `dapple run` writes its ranks' reports by default: a folder inside the plan directory.
RUN_DIR = "run"
#: What the ranks of a run write there (`backends.torch.launch` clears them before the next run).
RUN_FILES = (
    "rank_*.json",
    "rank_*_params.pt",
    "error_rank_*.json",
    "heartbeat_rank_*.json",
    "*.tmp",
    "torchrun.log",
)


#: What `simulate` and `run` add to a plan directory after compile; a plan directory owns them as regular files.
_LATER_FILES = (TIMELINE, TIMELINE_PICTURE, TIMELINE_MEASURED, TIMELINE_COMPARE)


def _owned(out: Path) -> set[str]:
    """What of `out` the product wrote: nothing, unless plan.json is a sealed plan (its digest checks); then
    plan.json, every file its digest lists (plan.dapple, rank files, report.txt) whose bytes are those it lists,
    the files `simulate` and `run` add, and a run folder holding nothing but its ranks' reports (a new plan
    replaces it with the rest: its reports belong to the old plan). Links, and files of a plan's names that it
    does not list, are the user's."""
    meta = _sealed_meta(out / PLAN_JSON) or {}
    files = meta.get(FILES)
    if not isinstance(files, dict):
        return set()
    listed = {**files, REPORT: meta.get(REPORT_SHA256)}
    owned = {PLAN_JSON} | {name for name, sha256 in listed.items() if _is_file_of(out / name, sha256)}
    owned |= {name for name in _LATER_FILES if _is_regular(out / name)}
    run = out / RUN_DIR
    if _is_regular(run, directory=True) and all(_is_regular(p) and _is_run_file(p) for p in run.iterdir()):
        owned.add(RUN_DIR)
    return owned


def _sealed_meta(path: Path) -> dict[str, Any] | None:
    if not _is_regular(path):
        return None
    try:
        meta = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return meta if isinstance(meta, dict) and meta.get(DIGEST) == json_digest(meta) else None


def _is_regular(path: Path, *, directory: bool = False) -> bool:
    """A file (or directory) that is not a symbolic link."""
    return not path.is_symlink() and (path.is_dir() if directory else path.is_file())


def _is_file_of(path: Path, sha256: object) -> bool:
    return isinstance(sha256, str) and _is_regular(path) and file_sha256(path) == sha256


def _is_run_file(path: Path) -> bool:
    return any(path.match(pattern) for pattern in RUN_FILES)


def check_output(out: Path, *, force: bool = False) -> None:
    """Refuse an output path whose contents dapple-ir did not write, before any work is done: a file,
    or a directory holding anything but plan files (unless `force`, which replaces it whole)."""
    recover_interrupted(out)
    if out.exists() and not out.is_dir():
        raise DappleError(f"output {out} is a file, not a directory; give a new or plan directory to write the plan")
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise DappleError(
            f"cannot write the plan directory {out}: {existing} is not a directory this user can write to"
        )
    if not out.is_dir() or force:
        return
    owned = _owned(out)
    foreign = sorted(p.name for p in out.iterdir() if p.name not in owned)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise DappleError(
            f"output directory {out} holds files dapple-ir did not write ({shown}); a plan replaces its directory "
            "whole, so choose another directory, or pass --force to replace it with everything in it"
        )


def recover_interrupted(out: Path) -> None:
    """Undo what a compile into `out` that was killed left beside it: between its two renames (the previous plan
    moved to `.NAME.old-PID`, the new one not yet at NAME) the previous plan is moved back; then the leftovers of
    dead compiles (`.NAME.old-PID`, `.NAME.new-PID-XXXX`) are removed. A compile still running keeps its own."""
    if not out.parent.is_dir():
        return
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(old|new)-([0-9]+)(-.*)?")
    leftovers = []
    for path in out.parent.iterdir():
        match = pattern.fullmatch(path.name)
        if match and _is_regular(path, directory=True) and not _alive(int(match.group(2))):
            leftovers.append((match.group(1), path))
    for kind, path in sorted(leftovers):  # "new" before "old": out is restored from the previous plan
        if kind == "old" and not out.exists() and not out.is_symlink():
            path.rename(out)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True  # another user's process: leave its files alone
    except (ProcessLookupError, OverflowError):
        return False
    return True


@dataclass
class Plan:
    """A loaded plan directory."""

    dir: Path
    module: Module
    meta: dict[str, Any]
    """The contents of plan.json."""
    ir_sha256: str
    """SHA-256 of plan.dapple's bytes."""

    @property
    def ranks(self) -> int:
        return len(self.module.programs)

    @property
    def microbatches(self) -> int:
        return int(self.meta.get("microbatches") or self.module.attrs.microbatches or 1)

    @property
    def microbatch_size(self) -> int:
        size = self.meta.get("microbatch_size") or self.module.attrs.microbatch_size
        if not size:
            raise DappleError(f"{self.dir / PLAN_JSON} gives no microbatch_size")
        return int(size)

    @property
    def global_batch(self) -> int:
        return self.microbatches * self.microbatch_size

    @property
    def model_spec(self) -> str:
        spec = self.meta.get("model_spec") or self.module.attrs.source
        if not spec:
            raise DappleError(f"{self.dir / PLAN_JSON} names no model_spec, so the model cannot be rebuilt")
        return str(spec)

    @property
    def seed(self) -> int:
        return int(self.meta.get("seed", 0))

    @property
    def lr(self) -> float | None:
        """plan.json's learning rate; None: the optimizer's default."""
        lr = self.meta.get("lr")
        return None if lr is None else float(lr)

    @property
    def digest(self) -> str:
        """The plan's digest (plan.json's `digest`, which covers every file of the plan), else the IR's."""
        return str(self.meta.get(DIGEST) or self.ir_sha256)

    def stage_nodes(self) -> dict[str, list[str]]:
        """IR op names of each stage, from plan.dapple."""
        return {s.name: [op.name for op in s.ops] for s in self.module.stages}


def ir_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ------------------------------------------------------------------------------------ digest

DIGEST = "digest"
"""plan.json's field holding the plan's digest: SHA-256 of plan.json's other fields in canonical JSON."""
FILES = "files"
"""plan.json's field mapping plan.dapple and every rank file to its SHA-256."""
SPEC_SHA256 = "model_spec_sha256"
REPORT_SHA256 = "report_sha256"
"""plan.json's field holding the SHA-256 of report.txt: what compile wrote there (not checked when the plan loads:
the report explains, nothing runs it), so that a later compile replaces it and never a user's file of that name."""
"""plan.json's field holding the SHA-256 of the model spec's file (the Python file run to rebuild the model)."""


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def json_digest(meta: dict[str, Any]) -> str:
    """SHA-256 of `meta` without its digest, in canonical JSON (sorted keys, no spaces)."""
    body = {k: v for k, v in meta.items() if k != DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def spec_file(spec: str) -> Path | None:
    """The file a model spec names: its Python file, a module's source file, or a profile; None if not found.

    Only a dotted module spec imports anything (its parent packages, to find the module's file)."""
    if spec.startswith("profile:"):
        return Path(spec.removeprefix("profile:"))
    where = spec.rpartition(":")[0]
    if where.endswith(".py") or "/" in where:
        return Path(where)
    # Looked up as `model_spec` imports it: the current directory comes first when it is not on the path.
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        found = importlib.util.find_spec(where)
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found is not None and found.origin else None


def spec_sha256(spec: str) -> str | None:
    """SHA-256 of the file `spec` names, or None when there is no such file."""
    path = spec_file(spec)
    return file_sha256(path) if path is not None and path.is_file() else None


def seal(directory: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` with the hashes of the plan's files (plan.dapple, rank files), of the model spec's file,
    and the digest over all of it, for the plan files in `directory`."""
    sealed = {k: v for k, v in meta.items() if k != DIGEST}
    names = sorted(
        (p.name for p in directory.iterdir() if p.name == PLAN_IR or _RANK_FILE.fullmatch(p.name)), key=_file_order
    )
    sealed[FILES] = {name: file_sha256(directory / name) for name in names}
    sealed["ir_sha256"] = sealed[FILES].get(PLAN_IR)
    sealed[REPORT_SHA256] = file_sha256(directory / REPORT) if (directory / REPORT).is_file() else None
    spec = meta.get("model_spec")
    sealed[SPEC_SHA256] = spec_sha256(spec) if isinstance(spec, str) and spec else None
    sealed[DIGEST] = json_digest(sealed)
    return sealed


def _file_order(name: str) -> tuple[int, str]:
    return (0, name) if name == PLAN_IR else (1, f"{len(name):04d}{name}")


def write_plan_json(directory: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Seal `meta` (`seal`) and write it as the plan.json of `directory`; returns what was written.
    Write the other plan files first: the digest covers them."""
    sealed = seal(directory, meta)
    tmp = directory / f".{PLAN_JSON}.tmp"
    tmp.write_text(json.dumps(sealed, indent=2) + "\n")
    tmp.replace(directory / PLAN_JSON)
    return sealed


def _check_digest(directory: Path, meta: dict[str, Any]) -> None:
    """Refuse a plan whose plan.json, plan.dapple or rank files changed since it was written."""
    json_path = directory / PLAN_JSON
    recompile = "recompile the plan with `dapple compile` (or undo the edit)"
    if DIGEST not in meta or FILES not in meta:
        raise DappleError(
            f"{json_path} carries no digest, so nothing vouches for the plan: it was replaced or edited (or "
            f"written by an older dapple-ir); {recompile}"
        )
    if meta[DIGEST] != json_digest(meta):
        raise DappleError(f"{json_path} was edited after compilation (it no longer matches its digest); {recompile}")
    files = meta[FILES]
    if not isinstance(files, dict) or PLAN_IR not in files:
        raise DappleError(f"{json_path} field {FILES} must map {PLAN_IR} and the rank files to their SHA-256")
    for name, sha256 in files.items():
        if name != PLAN_IR and not _RANK_FILE.fullmatch(name):
            raise DappleError(f"{json_path} field {FILES} names {name!r}, which is not a plan file")
        path = directory / name
        rank = "" if name == PLAN_IR else f"rank {name.removeprefix('rank_').removesuffix('.py')}: "
        if not path.is_file():
            raise DappleError(f"{rank}plan file {path} is missing; {recompile}")
        if file_sha256(path) != sha256:
            raise DappleError(
                f"{rank}{path} was edited after compilation (its SHA-256 differs from the one {PLAN_JSON} records); "
                f"{recompile}"
            )


def _check_fields(json_path: Path, meta: dict[str, Any]) -> None:
    """What the runtime obeys in plan.json has the type it needs, so a bad value fails here, not in a worker."""

    def bad(field: str, want: str) -> DappleError:
        return DappleError(f"{json_path} field {field} must be {want}, not {meta[field]!r}")

    seed = meta.get("seed")
    if seed is not None and (type(seed) is not int or not 0 <= seed < 2**63):
        raise bad("seed", "a whole number from 0 to 2**63 - 1")
    lr = meta.get("lr")
    if lr is not None and (type(lr) not in (int, float) or not math.isfinite(lr) or lr <= 0):
        raise bad("lr", "a positive finite number (or null: the optimizer's default)")
    for field in ("model_spec", "optimizer"):
        if meta.get(field) is not None and not isinstance(meta[field], str):
            raise bad(field, "a string")
    for field in ("microbatches", "microbatch_size"):
        value = meta.get(field)
        if value is not None and (type(value) is not int or value < 1):
            raise bad(field, "a positive whole number")


def check_model_spec(plan: Plan) -> None:
    """Refuse, before it is run, a model spec file that differs from the one the plan was compiled from."""
    spec = plan.model_spec
    current, recorded = spec_sha256(spec), plan.meta.get(SPEC_SHA256)
    if current == recorded:
        return
    path = spec_file(spec)
    if current is None:
        raise DappleError(
            f"the model spec {spec} of plan {plan.dir} names {path or 'a module'}, which cannot be found (relative "
            f"to {Path.cwd()}); run from the directory the plan was compiled in"
        )
    raise DappleError(
        f"{path}, the model spec file of plan {plan.dir}, changed since the plan was compiled (its SHA-256 differs "
        f"from the one {plan.dir / PLAN_JSON} records), so it is not run; recompile the plan with "
        f"`dapple compile {spec} ...`, or restore the file"
    )


def read_module(path: str | Path) -> Module:
    """The IR of a plan directory, or of an IR file given directly."""
    given = Path(path)
    file = given / PLAN_IR if given.is_dir() else given
    if not file.is_file():
        raise DappleError(f"{path} is neither an IR file nor a plan directory holding {PLAN_IR}")
    return parse_module(read_ir_file(file), str(file))


def write_plan_dir(
    out: Path,
    module: Module,
    meta: dict[str, Any],
    report: str,
    emit: Callable[[Module, Path], object] | None = None,
) -> None:
    """Write a plan directory beside `out` in a temporary directory, then rename it into place, so a
    failure leaves no half-written plan and the previous plan stays until the new one is complete.
    `emit(module, dir)` adds the backend's files (rank programs). `meta` gains the hashes of the files
    and the plan's digest (`seal`). Call `check_output` first: this replaces whatever `out` holds."""
    out = out.resolve()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.new-{os.getpid()}-", dir=out.parent))
    except OSError as exc:
        raise DappleError(f"cannot write the plan directory {out}: {exc.strerror or exc}") from None
    # mkdtemp makes the directory private (0700); a plan directory gets the usual mode.
    tmp.chmod(0o777 & ~current_umask())
    try:
        (tmp / PLAN_IR).write_text(print_module(module))
        (tmp / REPORT).write_text(report)
        if emit is not None:
            emit(module, tmp)
        meta.update(write_plan_json(tmp, meta))
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_file(path: Path, write: Callable[[Path], object]) -> None:
    """Write `path` through `write(temporary)` and rename that over it: a symbolic link at `path` is replaced, never
    followed, so nothing the product writes into a plan directory lands outside it; readers see the old file or the
    whole new one. The temporary file is created here (exclusively), so it cannot be a link either."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        tmp.chmod(0o666 & ~current_umask())  # mkstemp's 0600: the file gets the usual mode
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def current_umask() -> int:
    """The process's umask (set and restored at once: call it where no other thread creates files)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def load_plan(plan_dir: str | Path) -> Plan:
    """Load and cross-check a plan directory; every problem is a `DappleError` naming the file."""
    path = Path(plan_dir)
    if not path.is_dir():
        raise DappleError(f"plan directory {path} does not exist; create one with `dapple compile ... -o {path}`")
    run = path / RUN_DIR
    if run.is_symlink():
        raise DappleError(
            f"{run} is a symbolic link (to {os.readlink(run)}); `dapple run` writes and deletes its ranks' reports "
            "there and follows no link it did not make; remove the link (a plain directory, or none, is fine)"
        )
    json_path, ir_path = path / PLAN_JSON, path / PLAN_IR
    for needed in (json_path, ir_path):
        if not needed.is_file():
            raise DappleError(f"plan file {needed} is missing; recompile the plan with `dapple compile`")
    try:
        meta = json.loads(json_path.read_text())
    except json.JSONDecodeError as exc:
        raise DappleError(f"{json_path}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg}); was it edited?") from exc
    except (UnicodeDecodeError, RecursionError) as exc:
        raise DappleError(f"{json_path} is not valid JSON ({type(exc).__name__}); was it edited?") from None
    if not isinstance(meta, dict):
        raise DappleError(f"{json_path} must hold a JSON object")
    _check_digest(path, meta)
    _check_fields(json_path, meta)
    spec = str(meta.get("model_spec", ""))
    if spec.startswith("profile:"):
        raise DappleError(
            f"plan {path} was compiled from the imported profile {spec[len('profile:') :]}, which has costs but "
            "no executable model: it can be planned and simulated (`dapple simulate`), not run; compile a model "
            "spec (file.py:factory) to train"
        )
    text = read_ir_file(ir_path)
    module = parse_module(text, str(ir_path))
    plan = Plan(path, module, meta, ir_digest(text))
    _cross_check(plan)
    check_model_spec(plan)
    return plan


def _cross_check(plan: Plan) -> None:
    json_path = plan.dir / PLAN_JSON
    module = plan.module
    if not module.programs:
        raise DappleError(f"{plan.dir / PLAN_IR} holds no rank programs; the plan was not lowered")
    recorded = plan.meta.get("ir_sha256")
    if recorded and recorded != plan.ir_sha256:
        raise DappleError(f"{plan.dir / PLAN_IR} was edited after compilation (its hash differs from plan.json)")
    ranks = plan.meta.get("ranks")
    count = len(ranks) if isinstance(ranks, list) else ranks
    if count is not None and count != plan.ranks:
        raise DappleError(f"{json_path} says {count} ranks but {PLAN_IR} holds {plan.ranks} rank programs")
    for field in ("microbatches", "microbatch_size"):
        value = plan.meta.get(field)
        ir_value = getattr(module.attrs, field)
        if value is not None and ir_value is not None and value != ir_value:
            raise DappleError(f"{json_path} field {field} = {value} disagrees with {PLAN_IR} ({field} = {ir_value})")
    stages = plan.meta.get("stages")
    if not isinstance(stages, list):
        return
    ir_stages = plan.stage_nodes()
    if len(stages) != len(ir_stages):
        raise DappleError(f"{json_path} lists {len(stages)} stages but {PLAN_IR} has {len(ir_stages)}")
    for i, (entry, (name, nodes)) in enumerate(zip(stages, ir_stages.items(), strict=True)):
        json_nodes = entry.get("nodes") if isinstance(entry, dict) else None
        if json_nodes is not None and list(json_nodes) != nodes:
            raise DappleError(
                f"{json_path} stages[{i}].nodes disagrees with stage @{name} in {PLAN_IR}: one of them was edited"
            )
