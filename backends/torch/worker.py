"""What one rank does: rebuild its stages from the model spec, run its rank file for N steps, report.

Used in-process by the threads transport and, under torchrun, as the worker entry point:
`python -m torch.distributed.run --nproc-per-node R -m dapple_ir.backends.torch.worker PLAN_DIR --run-dir DIR ...`
(that is what `dapple run` launches). A worker writes `rank_<r>.json` (losses, peak memory, spans)
and `rank_<r>_params.pt` into the run directory, or `error_rank_<r>.json` when it fails.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import datetime
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dapple_ir.analysis.activation_checkpoints import segments as activation_segments
from dapple_ir.analysis.precision import precision_of
from dapple_ir.backends.torch import checkpoint
from dapple_ir.backends.torch.codegen import rank_sources
from dapple_ir.backends.torch.cores import pin_rank
from dapple_ir.backends.torch.data import DataFn, check_batch, data_function, synthetic_batch
from dapple_ir.backends.torch.runtime import DEFAULT_LR, METERED_STEPS, OPTIMIZERS, Runtime, StepData
from dapple_ir.backends.torch.stage_module import StageModule, model_param_names, split_stage
from dapple_ir.backends.torch.tensor_graph import shard_stage
from dapple_ir.backends.torch.tensor_parallel import TensorGroup, tensor_groups
from dapple_ir.backends.torch.transport import DistTransport, Transport, TransportError
from dapple_ir.errors import DappleError
from dapple_ir.frontend.model_spec import FactoryResult, capture_loaded, load_model_spec
from dapple_ir.frontend.runnable import bind_model, retarget_devices
from dapple_ir.frontend.trace_device import trace_device_for
from dapple_ir.ir import InstrKind, Module, OpKind
from dapple_ir.ir.structure import first_difference, structure_hash
from dapple_ir.plan_dir import Plan, load_plan, rank_file


@dataclass
class RunOptions:
    """Choices of one run that every rank shares."""

    steps: int
    optimizer: str
    lr: float
    timeout: float
    run_dir: str
    save: str | None = None
    resume: str | None = None
    device: str = "cpu"
    """`cpu` or `cuda`."""
    check: bool = False
    """Record the gradients of step 0 for `--check` (the runtime's `record_grads`)."""
    save_every: int | None = None
    """With `save`: also save after every step whose number (counted from the first step ever, resumed
    steps included) is a multiple of this, so a fault loses at most that many steps."""
    reuse_buffers: bool = True
    """Receive into buffers kept per shape and reused once free (`ReceiveBuffers`); False: a new one per receive."""
    meter_every_step: bool = False
    """CPU: count the held bytes after every instruction of every step, not only of the first `METERED_STEPS`."""
    pin_cores: bool = True
    """CPU: each local rank on a block of cores of its own where there are as many cores as local ranks
    (`cores.pin_rank`); False: wherever the OS puts it."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise DappleError(f"steps must be at least 1, not {self.steps}")
        if self.save_every is not None and self.save_every < 1:
            raise DappleError(f"--save-every must be at least 1 step, not {self.save_every}")
        if self.save_every is not None and not self.save:
            raise DappleError("--save-every needs --save DIR: the directory the checkpoints go to")
        if not math.isfinite(self.timeout) or self.timeout <= 0:
            raise DappleError(f"timeout must be a positive number of seconds, not {self.timeout}")


@dataclass
class Prepared:
    """The model rebuilt from the plan's spec and seed, its planned graph, and its data source."""

    model: torch.nn.Module
    graph_module: torch.fx.GraphModule
    example_inputs: tuple[Any, ...]
    """Positional, then keyword example inputs."""
    example_targets: tuple[Any, ...]
    data_fn: DataFn | None
    """`dapple_data` of the spec's file, if it defines one."""
    input_index: dict[str, int]
    """Position of each graph input (IR input op) in the flat tuple inputs + targets."""
    structure_hash: str
    captured_module: Module
    """The IR of the graph, to name what differs when it does not match the plan."""
    any_batch: bool
    """Whether the graph runs at any batch size (`Captured.any_batch`), or only at the captured one."""

    def batch_of_step(self, step: int, global_batch: int, seed: int) -> tuple[Any, ...]:
        """The flat global batch (inputs, then targets) of `step`."""
        if self.data_fn is None:
            inputs, targets = synthetic_batch(self.example_inputs, self.example_targets, global_batch, seed, step)
        else:
            inputs, targets = self.data_fn(step, global_batch, seed)
            check_batch(tuple(inputs), tuple(targets), global_batch, "dapple_data")
        return (*inputs, *targets)


#: Captures already made in this process, by (spec, seed, method, spec file mtime). Ranks and runs deep-copy
#: the model before training, so the cached one keeps its initial values.
_PREPARED: dict[tuple[str, int, str, float], Prepared] = {}


def prepare_model(plan: Plan) -> Prepared:
    """Build the model exactly as the single-device reference does, capture it, check the plan's hash."""
    method = plan.module.attrs.capture_method or "auto"
    spec_file = Path(plan.model_spec.rpartition(":")[0])
    key = (plan.model_spec, plan.seed, method, spec_file.stat().st_mtime if spec_file.is_file() else 0.0)
    if key not in _PREPARED:
        _PREPARED[key] = _prepare(plan, method)
    prepared = _PREPARED[key]
    recorded = plan.meta.get("model_hash")
    if recorded and recorded != prepared.structure_hash:
        where = first_difference(plan.module, prepared.captured_module) or "the structure hash differs"
        raise DappleError(
            f"the model that {plan.model_spec} builds no longer matches the plan in {plan.dir}: {where}. The model "
            "(or the torch or transformers version) changed since the plan was compiled; recompile the plan with "
            f"`dapple compile {plan.model_spec} ...` (or run the model the plan was compiled from)"
        )
    batch = prepared.captured_module.attrs.batch
    if not prepared.any_batch:
        b = plan.microbatch_size
        # Samples each stage runs at once: the microbatch, or a split replica's rows of it.
        needed = {hi - lo for s in plan.module.stages for lo, hi in (s.rows(j, b) for j in range(s.replicas))} or {b}
        if needed != {batch}:
            raise DappleError(
                f"the graph of {plan.model_spec} only runs at the batch it was captured at ({batch}): export could "
                f"not keep dimension 0 symbolic, so its stages cannot run on {', '.join(map(str, sorted(needed)))} "
                f"sample(s) at a time, as microbatches of {b} (split replicas: their rows) need; let the model read "
                f"the batch size from its inputs, or give the factory example inputs of that size ({b}) and compile "
                "again"
            )
    return prepared


def _prepare(plan: Plan, method: str) -> Prepared:
    # The graph is captured exactly as compile captured it, from the factory on the meta device, shown as the
    # plan's cluster's device (trace_device), so it is the planned graph op for op (a capture on the CPU traces
    # the CPU's kernels, which differ).
    planned = _factory(plan, "meta")
    trace_device = trace_device_for(str(plan.meta.get("cluster") or ""))
    captured = capture_loaded(planned, method=method, annotate_costs=False, trace_device=trace_device)
    del planned
    # The weights come from the factory on the CPU after seeding, as the single-device reference builds them.
    loaded = _factory(plan, "cpu")
    graph_module = bind_model(captured, loaded.model, loaded.loss_fn)
    kwargs = loaded.example_kwargs or {}
    examples = (*loaded.example_inputs, *kwargs.values())
    targets = loaded.example_targets
    placeholders = [n.name for n in graph_module.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(examples) + len(targets):
        raise DappleError(
            f"the captured graph of {plan.model_spec} takes {len(placeholders)} inputs but the factory gives "
            f"{len(examples) + len(targets)} example inputs and targets"
        )
    return Prepared(
        loaded.model,
        graph_module,
        examples,
        targets,
        data_function(plan.model_spec),
        {n: i for i, n in enumerate(placeholders)},
        structure_hash(captured.module),
        captured.module,
        captured.any_batch,
    )


def _factory(plan: Plan, device: str) -> FactoryResult:
    loaded = load_model_spec(plan.model_spec, device=device, seed=plan.seed)
    if not isinstance(loaded, FactoryResult):
        raise DappleError(f"model spec {plan.model_spec} is an imported profile: it can be planned, not run")
    return loaded


def hosted_stages(module: Module, rank: int) -> list[str]:
    program = module.programs[rank]
    if program.attrs.stages:
        return list(program.attrs.stages)
    names: list[str] = []
    for instr in program.instrs:
        if instr.kind is InstrKind.FORWARD and instr.stage is not None and instr.stage.name not in names:
            names.append(instr.stage.name)
    return names


def tied_params(module: Module) -> set[str]:
    """Parameters read by ops of more than one stage (each such stage holds its own copy)."""
    readers: dict[str, set[str]] = {}
    for stage in module.stages:
        for op in stage.ops:
            names = set(op.attrs.params or ())
            if op.kind is OpKind.GET_ATTR and op.target:
                names.add(op.target)
            for name in names:
                readers.setdefault(name, set()).add(stage.name)
    return {name for name, stages in readers.items() if len(stages) > 1}


def build_runtime(
    plan: Plan, rank: int, prepared: Prepared, transport: Transport, options: RunOptions, device: torch.device
) -> Runtime:
    """Rank `rank`'s runtime: its stages cut from a private copy of the model (nothing shared with other ranks)."""
    model, graph_module = copy.deepcopy((prepared.model, prepared.graph_module))
    retarget_devices(graph_module, device)
    names = model_param_names(model)
    nodes = plan.stage_nodes()
    stages: dict[str, StageModule] = {}
    groups = tensor_groups(plan.module, lambda r: hosted_stages(plan.module, r))
    replica = plan.module.programs[rank].attrs.replica or 0
    for name in hosted_stages(plan.module, rank):
        stages[name] = split_stage(graph_module, name, nodes[name], names)
        ranks = groups.get((name, replica))
        if ranks is not None:  # a tensor-parallel stage: this member's slices and collectives
            group = TensorGroup(name, ranks, ranks.index(rank), transport, options.timeout)
            shard_stage(stages[name], plan.module, group)
    del model, graph_module
    value_ids = {op.name: i for i, op in enumerate(plan.module.ops)}
    rows = split_rows(plan.module, rank, plan.microbatch_size)
    data = StepData(
        lambda step: prepared.batch_of_step(step, plan.global_batch, plan.seed),
        prepared.input_index,
        plan.microbatch_size,
        rows,
    )
    return Runtime(
        rank,
        stages,
        transport,
        data,
        microbatches=plan.microbatches,
        value_ids=value_ids,
        optimizer=options.optimizer,
        lr=options.lr,
        timeout=options.timeout,
        device=device,
        tied=tied_params(plan.module),
        seed=plan.seed,
        record_grads=options.check,
        recompute={
            s.name: [{op.name for op in ops} for ops in activation_segments(plan.module, s)]
            for s in plan.module.stages
            if s.recompute
        },
        rows=rows,
        meter_steps=None if options.meter_every_step else METERED_STEPS,
        precision=precision_of(plan.module),
        zero={
            i.stage.name: i.group
            for i in plan.module.programs[rank].instrs
            if i.kind is InstrKind.REDUCE_SCATTER and i.stage is not None and i.group is not None
        },
    )


def split_rows(module: Module, rank: int, microbatch_size: int) -> tuple[int, int] | None:
    """The rows of each microbatch rank `rank`'s stages compute when they split microbatches over their
    replicas (`StageAttrs.split`), else None; every stage a rank hosts must slice alike."""
    program = module.programs[rank]
    replica = program.attrs.replica or 0
    found = {module.stage(name).rows(replica, microbatch_size) for name in hosted_stages(module, rank)}
    if len(found) > 1:
        raise DappleError(f"rank {rank} hosts stages that take different rows of a microbatch: {sorted(found)}")
    rows = found.pop() if found else (0, microbatch_size)
    return None if rows == (0, microbatch_size) else rows


def check_rank_file(plan: Plan, rank: int) -> str:
    """The source of `rank_<r>.py`, which must be exactly what codegen makes of plan.dapple."""
    path = plan.dir / rank_file(rank)
    expected = rank_sources(plan.module, plan.ir_sha256)[rank]
    if not path.is_file():
        raise DappleError(f"rank {rank}: {path} is missing; recompile the plan (or re-emit the rank files)")
    if path.read_text() != expected:
        raise DappleError(
            f"rank {rank}: {path} differs from what plan.dapple generates (edited, or plan.dapple changed "
            "since it was written); recompile the plan"
        )
    return expected


def rank_train_step(plan: Plan, rank: int) -> Callable[[Runtime], None]:
    """`train_step` of `rank_<r>.py`; only a file identical to what codegen writes is ever run."""
    source = check_rank_file(plan, rank)
    namespace: dict[str, Any] = {"__name__": f"dapple_rank_{rank}"}
    exec(compile(source, str(plan.dir / rank_file(rank)), "exec"), namespace)
    return namespace["train_step"]  # type: ignore[no-any-return]


def train_rank(plan: Plan, rank: int, rt: Runtime, options: RunOptions) -> dict[str, Any]:
    """Resume if asked, run the steps, save if asked (every `save_every` steps and after the last);
    returns the rank's report (JSON data)."""
    train_step = rank_train_step(plan, rank)
    if options.resume:
        load_checkpoint(rt, Path(options.resume), plan)
    for done in range(1, options.steps + 1):
        rt.run_step(train_step)
        periodic = options.save_every is not None and rt.step % options.save_every == 0
        if options.save and (periodic or done == options.steps):
            save_checkpoint(rt, Path(options.save), plan)
    return {
        "rank": rank,
        "device": str(rt.device),
        "losses": {str(k): {str(m): v for m, v in mbs.items()} for k, mbs in rt.losses.items()},
        "peak_bytes": rt.peak_bytes,
        "spans": [asdict(s) for s in rt.spans],
        "memory": rt.memory,
        "step_times": {str(k): v for k, v in rt.step_times.items()},
        "stages": list(rt.stages),
    }


def final_params(rt: Runtime) -> dict[str, Any]:
    """What the rank ends with for the launcher and `--check`: see `Runtime.final_state`."""
    return rt.final_state()


def check_checkpoints(plan: Plan, options: RunOptions) -> None:
    """Refuse, before any rank trains, a `--save` directory that cannot be written or a `--resume`
    checkpoint that does not match the plan (manifest, ranks, every file's size and hash)."""
    if options.save:
        checkpoint.check_save_dir(Path(options.save))
    if options.resume:
        checkpoint.verify(Path(options.resume), plan.digest, plan.ranks)


def save_checkpoint(rt: Runtime, directory: Path, plan: Plan) -> None:
    """Save the rank's state at its current step; every rank of the plan calls this at the same step."""
    world = tuple(range(plan.ranks))

    def barrier() -> None:
        # Rank 0 commits the manifest only once every rank's file is on disk.
        rt.transport.allreduce(torch.zeros(1, device=rt.device), world, rt.timeout)

    state = rt.state_dict()
    checkpoint.save(state, directory, rank=rt.rank, world_size=plan.ranks, plan_digest=plan.digest, barrier=barrier)


def load_checkpoint(rt: Runtime, directory: Path, plan: Plan) -> None:
    rt.load_state_dict(checkpoint.load(directory, rt.rank, plan.digest, expected=rt.state_dict()))


# ------------------------------------------------------------------------------ error reports


def error_report(rank: int, exc: BaseException, when: float | None = None) -> dict[str, Any]:
    """What a failing rank writes: its message, when it failed, and whether it only echoes another failure.

    `when` is the moment the error was raised (`failure_time`), not the later moment the report is
    written: closing the transport can take a while, and the launcher orders failures by this time.
    """
    secondary = is_echo(exc)
    message = str(exc) if isinstance(exc, DappleError) else f"rank {rank}: {type(exc).__name__}: {_first_line(exc)}"
    if not message.startswith(f"rank {rank}"):
        message = f"rank {rank}: {message}"
    return {
        "rank": rank,
        "time": when if when is not None else failure_time(exc),
        "secondary": secondary,
        "message": message,
        "traceback": traceback.format_exception(exc),
    }


def is_echo(exc: BaseException) -> bool:
    """Whether `exc` is a lost peer or a wait that ran out: the echo of a failure elsewhere, not a cause."""
    if isinstance(exc, TransportError | ConnectionError | TimeoutError):
        return True
    if isinstance(exc, dist.DistError) and not isinstance(exc, dist.DistBackendError):
        return True  # store and network errors (DistNetworkError, DistStoreError): the peer or the store is gone
    text = str(exc)
    return any(echo in text for echo in _ECHOES)


#: What gloo and the store say when a peer went away.
_ECHOES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")


def failure_time(exc: BaseException) -> float:
    """When `exc` was first seen failing (`mark_failure`), else now."""
    return float(getattr(exc, "_dapple_failed_at", time.time()))


def mark_failure(exc: BaseException) -> None:
    """Record now as the moment `exc` failed, unless an earlier handler already did."""
    if not hasattr(exc, "_dapple_failed_at"):
        with contextlib.suppress(AttributeError):
            exc._dapple_failed_at = time.time()  # type: ignore[attr-defined]


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def write_json(path: Path, data: Any) -> None:
    """Write `data` as JSON atomically: readers see the old file or the whole new one, never a part."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # one per writer
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


# ------------------------------------------------------------------------------ liveness


#: Environment variable holding the pid of the process whose death must end this one (set by the launcher).
PARENT_PID_ENV = "DAPPLE_PARENT_PID"


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """End this process with `signum` when its parent dies, even if the parent is killed with SIGKILL.

    On Linux the kernel does it (PR_SET_PDEATHSIG); elsewhere a thread polls the parent's pid. A parent
    that died before this call is noticed at once: the parent pid then differs from `DAPPLE_PARENT_PID`.
    """
    expected = os.environ.get(PARENT_PID_ENV)
    if expected is None:
        return  # not started by dapple's launcher (a hand-run torchrun): nothing to tie to
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:
        parent = os.getppid()
        threading.Thread(target=_watch_parent, args=(parent, signum), name="dapple-parent-watch", daemon=True).start()
    if str(os.getppid()) != expected:
        os.kill(os.getpid(), signum)


_PR_SET_PDEATHSIG = 1


def _watch_parent(parent: int, signum: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os.kill(os.getpid(), signum)


class Heartbeat:
    """Writes `heartbeat_rank_<r>.json` about every `interval` seconds: pid, phase, step and progress.

    The launcher's watchdog reads it: `progress` (instructions completed) that stops changing means a
    stuck rank; a file that stops being rewritten means a process that no longer runs (stopped, frozen).
    Phases: preparing (capture, rendezvous), training, finishing, done, failed.
    """

    def __init__(self, run_dir: Path, rank: int, interval: float) -> None:
        self.path = run_dir / heartbeat_file(rank)
        self.rank = rank
        self.interval = interval
        self.phase = "preparing"
        self.runtime: Runtime | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._beat, name="dapple-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.write()
        self._thread.start()
        return self

    def set(self, phase: str, runtime: Runtime | None = None) -> None:
        self.phase = phase
        self.runtime = runtime or self.runtime
        self.write()

    def stop(self, phase: str) -> None:
        self._stop.set()
        self._thread.join(self.interval * 2)
        self.set(phase)

    def write(self) -> None:
        rt = self.runtime
        step, progress = (rt.step, rt.step + len(rt.spans)) if rt is not None else (None, 0)
        data = {"rank": self.rank, "pid": os.getpid(), "phase": self.phase, "step": step, "progress": progress}
        # The beating thread and the rank's own phase changes write the same file. A full disk must not
        # kill the rank: the watchdog notices the silence.
        with self._lock, contextlib.suppress(OSError):
            write_json(self.path, {**data, "time": time.time()})

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            self.write()


def heartbeat_file(rank: int | str) -> str:
    return f"heartbeat_rank_{rank}.json"


def heartbeat_interval(timeout: float) -> float:
    """Seconds between beats: often enough that the watchdog sees a frozen rank well within `timeout`."""
    return max(0.05, min(1.0, timeout / 10))


# ------------------------------------------------------------------------------ torchrun entry


def resolve_optimizer(plan: Plan, optimizer: str | None, lr: float | None) -> tuple[str, float]:
    """The optimizer and learning rate of a run: given ones, else plan.json's, else sgd / torch's defaults."""
    chosen = optimizer or plan.meta.get("optimizer") or plan.module.attrs.optimizer or "sgd"
    name = str(chosen).lower()
    if name not in OPTIMIZERS:
        raise DappleError(f"unknown optimizer '{chosen}'; choose one of {', '.join(OPTIMIZERS)}")
    if lr is None:
        return name, plan.lr if plan.lr is not None else DEFAULT_LR[name]
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not math.isfinite(lr) or lr <= 0:
        raise DappleError(f"the learning rate must be a positive finite number, not {lr!r}")
    return name, float(lr)


def pin_cpu(options: RunOptions) -> bool:
    """Whether a torchrun rank pins itself to cores of its own (`cores.pin_rank`): CPU ranks, unless told not to."""
    return options.pin_cores and options.device == "cpu"


def worker_flags(options: RunOptions) -> list[str]:
    """The command-line flags of `main` that reproduce `options`."""
    flags = [f"--steps={options.steps}", f"--optimizer={options.optimizer}", f"--lr={options.lr!r}"]
    flags += [f"--timeout={options.timeout!r}", f"--run-dir={options.run_dir}", f"--device={options.device}"]
    flags += [f"--save={options.save}"] if options.save else []
    flags += [f"--resume={options.resume}"] if options.resume else []
    flags += [f"--save-every={options.save_every}"] if options.save_every is not None else []
    flags += ["--check"] if options.check else []
    flags += [] if options.reuse_buffers else ["--fresh-buffers"]
    flags += ["--meter-every-step"] if options.meter_every_step else []
    flags += [] if options.pin_cores else ["--no-pin"]
    return flags


def worker_parser() -> argparse.ArgumentParser:
    """The command line of `main` (`worker_flags` writes it)."""
    parser = argparse.ArgumentParser(
        description="Run one rank of a plan (start it with torchrun, one process per rank; `dapple run` does).",
        epilog="example:\n  torchrun --nproc-per-node 4 -m dapple_ir.backends.torch.worker plans/gpt --steps 5",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("plan_dir")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--optimizer", help="default: plan.json's, else sgd")
    parser.add_argument("--lr", type=float, help="default: plan.json's, else torch's default for the optimizer")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may last")
    parser.add_argument("--run-dir", help="where ranks report (default PLAN_DIR/run)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--save")
    parser.add_argument("--resume")
    parser.add_argument("--save-every", type=int, help="with --save: also save every N steps")
    parser.add_argument("--check", action="store_true", help="record the gradients of step 0 for dapple run --check")
    parser.add_argument(
        "--fresh-buffers", action="store_true", help="allocate every receive's buffer anew instead of reusing them"
    )
    parser.add_argument(
        "--meter-every-step",
        action="store_true",
        help="CPU: count the bytes held after every instruction of every step (default: the first two steps)",
    )
    parser.add_argument(
        "--no-pin", action="store_true", help="CPU: leave the rank wherever the OS puts it (default: its own cores)"
    )
    return parser


def options_from_args(args: argparse.Namespace, optimizer: str, lr: float, run_dir: Path) -> RunOptions:
    """The `RunOptions` that `worker_flags` wrote, parsed back (optimizer and lr resolved against the plan)."""
    return RunOptions(
        steps=args.steps,
        optimizer=optimizer,
        lr=lr,
        timeout=args.timeout,
        run_dir=str(run_dir),
        save=args.save,
        resume=args.resume,
        device=args.device,
        check=args.check,
        save_every=args.save_every,
        reuse_buffers=not args.fresh_buffers,
        meter_every_step=args.meter_every_step,
        pin_cores=not args.no_pin,
    )


def main(argv: list[str] | None = None) -> int:
    args = worker_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    run_dir = Path(args.run_dir or Path(args.plan_dir) / "run")
    run_dir.mkdir(parents=True, exist_ok=True)
    die_with_parent()  # torchrun gone (its launcher killed, even with SIGKILL): this rank goes too
    heartbeat = Heartbeat(run_dir, rank, heartbeat_interval(args.timeout)).start()
    try:
        optimizer, lr = resolve_optimizer(load_plan(args.plan_dir), args.optimizer, args.lr)
        options = options_from_args(args, optimizer, lr, run_dir)
        report, params = _run_torchrun_rank(args.plan_dir, rank, options, heartbeat)
    except BaseException as exc:
        mark_failure(exc)
        report_path = run_dir / f"error_rank_{rank}.json"
        if not report_path.is_file():  # written already if the rank failed while its peers were connected
            write_json(report_path, error_report(rank, exc))
        heartbeat.stop("failed")
        print(f"dapple worker: {error_report(rank, exc)['message']}", file=sys.stderr)
        return 1
    torch.save(params, run_dir / f"rank_{rank}_params.pt")
    write_json(run_dir / f"rank_{rank}.json", report)
    heartbeat.stop("done")
    return 0


def _run_torchrun_rank(
    plan_dir: str, rank: int, options: RunOptions, heartbeat: Heartbeat | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    plan = load_plan(plan_dir)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan.ranks:
        raise DappleError(f"the plan in {plan.dir} has {plan.ranks} ranks but {world} processes were launched")
    use_cuda = options.device == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    # Before gloo and torch start their threads, which then inherit the rank's cores.
    cores = pin_rank(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", world))) if pin_cpu(options) else None
    if options.save:  # the launcher checked the whole --resume checkpoint; each rank checks its file as it loads
        checkpoint.check_save_dir(Path(options.save))
    prepared = prepare_model(plan)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=options.timeout))
    groups = [tuple(i.group) for p in plan.module.programs for i in p.instrs if i.group]
    groups.append(tuple(range(plan.ranks)))  # the barrier of a checkpoint save
    # The tensor groups' own (their sums run inside the stages' computations), also where no instruction lists them.
    groups += tensor_groups(plan.module, lambda r: hosted_stages(plan.module, r)).values()
    transport = DistTransport(groups, device, reuse_buffers=options.reuse_buffers)
    try:
        rt = build_runtime(plan, rank, prepared, transport, options, device)
        if heartbeat is not None:
            heartbeat.set("training", rt)
        report = train_rank(plan, rank, rt, options)
        if heartbeat is not None:
            heartbeat.set("finishing")
        transport.finish(options.timeout)
        report["recv_buffers"] = transport.buffers.counts()
        report["cores"] = cores
        return report, final_params(rt)
    except BaseException as exc:
        # Report now, while the peers still wait on this rank: closing the transport below makes their
        # waits fail, and the launcher must see this rank's error first (by time and on disk).
        mark_failure(exc)
        with contextlib.suppress(OSError):
            write_json(Path(options.run_dir) / f"error_rank_{rank}.json", error_report(rank, exc))
        raise
    finally:
        transport.close()


if __name__ == "__main__":
    sys.exit(main())
