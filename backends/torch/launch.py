"""`run(plan_dir, steps=...)`: train a plan on as many processes (or threads) as it has ranks.

Two transports: `torchrun` starts `torch.distributed.run` with one worker process per rank (gloo on
CPU, NCCL on CUDA; rendezvous on 127.0.0.1 unless told otherwise, multi-node with `nnodes`,
`node_rank`, `rdzv_endpoint`); `threads` runs every rank as a thread of this process with an
in-process transport (tests, single-GPU machines). Either way each rank reports into a run
directory, and this module aggregates: the loss of every step, samples/s, peak memory per rank, the
measured timeline (`timeline_measured.json`, the simulator's trace format), and with `check=True`
the comparison against single-device training.

A failing rank writes its error and stops; the others stop within the timeout (their waits are
bounded, torchrun ends the group), and `run` raises `RuntimeFailure` with the first failing rank's
message, not the echoes of the others.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed

from dapple_ir import plan_dir
from dapple_ir.backends.torch.transport import ThreadHub, ThreadTransport
from dapple_ir.backends.torch.worker import (
    RunOptions,
    build_runtime,
    check_rank_file,
    error_report,
    final_params,
    prepare_model,
    resolve_optimizer,
    train_rank,
    worker_flags,
)
from dapple_ir.errors import DappleError, RuntimeFailure
from dapple_ir.plan_dir import Plan, load_plan
from dapple_ir.sim.trace import MemorySample, Span, Timeline, write_trace

#: fp32 tolerances of PyTorch's own pipelining tests.
RTOL, ATOL = 1e-5, 4e-5


@dataclass
class CheckResult:
    """Pipelined vs single-device training after the same steps."""

    max_loss_diff: float
    max_param_diff: float
    worst_param: str
    ok: bool


@dataclass
class RunResult:
    """What a run measured."""

    losses: list[float]
    """Mean microbatch loss of each step run, in order."""
    first_step: int
    """Index of the first step run (non-zero after a resume)."""
    samples_per_s: float
    """Global-batch samples per second over the steps after the first (all steps when only one ran)."""
    peak_bytes: list[int]
    """Measured peak memory of each rank."""
    devices: list[str]
    timeline: Path | None
    params: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)
    """Final parameters per rank, `stage/name` keys."""
    check: CheckResult | None = None


def run(
    plan_dir: str | Path,
    *,
    steps: int,
    check: bool = False,
    transport: str = "torchrun",
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    save: str | Path | None = None,
    resume: str | Path | None = None,
    optimizer: str | None = None,
    lr: float | None = None,
    timeout: float = 120.0,
    device: str = "auto",
    run_dir: str | Path | None = None,
) -> RunResult:
    """Train the plan in `plan_dir` for `steps` optimizer steps; see the module docstring."""
    if steps < 1:
        raise DappleError(f"steps must be at least 1, not {steps}")
    plan = load_plan(plan_dir)
    opt, rate = resolve_optimizer(plan, optimizer, lr)
    out = Path(run_dir) if run_dir is not None else plan.dir / "run"
    _clean(out)
    options = RunOptions(
        steps=steps,
        optimizer=opt,
        lr=rate,
        timeout=timeout,
        run_dir=str(out),
        save=str(save) if save is not None else None,
        resume=str(resume) if resume is not None else None,
        device=_pick_device(device, transport, plan.ranks // max(nnodes, 1)),
    )
    if transport not in ("threads", "torchrun"):
        raise DappleError(f"unknown transport '{transport}'; choose torchrun or threads")
    if nnodes < 1 or plan.ranks % nnodes:
        raise DappleError(f"the plan's {plan.ranks} ranks do not divide evenly over {nnodes} nodes")
    if check and nnodes > 1:
        raise DappleError("--check compares every rank's parameters, so it needs all ranks on one node (nnodes = 1)")
    for rank in range(plan.ranks):
        check_rank_file(plan, rank)  # refuse a stale or edited rank file before starting any process
    if transport == "torchrun":
        _check_torchrun_can_start(rdzv_endpoint, node_rank)
    # Threads share this process's cores: one intra-op pool per rank would oversubscribe them, and
    # spinning pools on a busy machine run many times slower than a single thread each.
    threads = max(1, (os.cpu_count() or 1) // plan.ranks) if transport == "threads" else torch.get_num_threads()
    with _intra_op_threads(threads):
        if transport == "threads":
            reports, params = _run_threads(plan, options)
        else:
            reports, params = _run_torchrun(plan, options, nnodes, node_rank, rdzv_endpoint)
        result = _aggregate(plan, reports, params)
        if check:
            result.check = _check(plan, result, opt, rate)
    return result


@contextmanager
def _intra_op_threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _pick_device(device: str, transport: str, per_node: int) -> str:
    if device in ("cpu", "cuda"):
        if device == "cuda" and not torch.cuda.is_available():
            raise DappleError("device cuda was asked for but torch sees no CUDA device")
        return device
    if device != "auto":
        raise DappleError(f"unknown device '{device}'; choose auto, cpu or cuda")
    if not torch.cuda.is_available():
        return "cpu"
    return "cuda" if transport == "threads" or torch.cuda.device_count() >= per_node else "cpu"


def _clean(run_dir: Path) -> None:
    """Remove an earlier run's reports (only the files ranks write), so none is mistaken for this run's."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for pattern in ("rank_*.json", "rank_*_params.pt", "error_rank_*.json", "*.tmp", "torchrun.log"):
        for stale in run_dir.glob(pattern):
            stale.unlink()


# ------------------------------------------------------------------------------------- threads


def _run_threads(plan: Plan, options: RunOptions) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    prepared = prepare_model(plan)
    hub = ThreadHub(plan.ranks)
    device = torch.device("cuda", 0) if options.device == "cuda" else torch.device("cpu")
    runtimes = [build_runtime(plan, r, prepared, ThreadTransport(hub, r), options, device) for r in range(plan.ranks)]
    reports: dict[int, dict[str, Any]] = {}
    errors: dict[int, dict[str, Any]] = {}

    def body(rank: int) -> None:
        try:
            reports[rank] = train_rank(plan, rank, runtimes[rank], options)
        except BaseException as exc:
            errors[rank] = error_report(rank, exc)
            hub.fail(rank, errors[rank]["message"])

    threads = [
        threading.Thread(target=body, args=(r,), name=f"dapple-rank-{r}", daemon=True) for r in range(plan.ranks)
    ]
    for t in threads:
        t.start()
    for t in threads:
        # Every wait inside is bounded by the timeout; this join only guards against a stuck compute.
        t.join(options.timeout * (options.steps + 2) + 60)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck and not errors:
        raise RuntimeFailure(f"rank(s) {stuck} did not finish; a compute call is stuck")
    if errors:
        raise RuntimeFailure(_first_failure(errors, set(range(plan.ranks)) - set(reports) - set(errors)))
    return reports, {r: final_params(rt) for r, rt in enumerate(runtimes)}


# ------------------------------------------------------------------------------------ torchrun


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check_torchrun_can_start(rdzv_endpoint: str | None, node_rank: int) -> None:
    """Refuse, before any process starts, a launch that could only fail or hang."""
    if not torch.distributed.is_available():
        raise DappleError(
            f"this torch build ({torch.__version__}) has no torch.distributed, so torchrun cannot start "
            "the ranks; install a torch build with distributed support, or run all ranks in one process "
            "with --transport threads"
        )
    if not rdzv_endpoint or node_rank != 0:
        return
    host, _, port = rdzv_endpoint.rpartition(":")
    if host not in ("127.0.0.1", "localhost", "0.0.0.0", "") or not port.isdigit():
        return
    # Node 0 hosts the rendezvous store: a port someone else holds would make torchrun hang or fail late.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1" if host in ("localhost", "") else host, int(port)))
        except OSError:
            raise DappleError(
                f"port {port} of the rendezvous endpoint {rdzv_endpoint} is already in use (another run or "
                "program holds it); pick another port, or leave out --rdzv-endpoint to use a free one"
            ) from None


def torchrun_command(
    plan: Plan, options: RunOptions, nnodes: int, node_rank: int, rdzv_endpoint: str | None
) -> list[str]:
    """The torchrun command line that `run` starts (one worker process per local rank)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={plan.ranks // nnodes}",
        f"--node-rank={node_rank}",
        "--max-restarts=0",
        "--monitor-interval=0.1",
    ]
    if rdzv_endpoint:
        command += ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=dapple"]
    else:
        # Static rendezvous on loopback: nothing listens beyond this machine.
        command += ["--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    command += ["-m", "dapple_ir.backends.torch.worker", str(plan.dir), *worker_flags(options)]
    return command


def _run_torchrun(
    plan: Plan, options: RunOptions, nnodes: int, node_rank: int, rdzv_endpoint: str | None
) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    run_dir = Path(options.run_dir)
    log_path = run_dir / "torchrun.log"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    command = torchrun_command(plan, options, nnodes, node_rank, rdzv_endpoint)
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            code = proc.wait(timeout=options.timeout * (options.steps + 2) + 120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = -9
    per_node = plan.ranks // nnodes
    local = range(node_rank * per_node, (node_rank + 1) * per_node)
    errors = {}
    for rank in local:
        path = run_dir / f"error_rank_{rank}.json"
        if path.is_file():
            errors[rank] = json.loads(path.read_text())
    reports = {}
    for rank in local:
        path = run_dir / f"rank_{rank}.json"
        if path.is_file():
            reports[rank] = json.loads(path.read_text())
    silent = set(local) - set(reports) - set(errors)
    if errors or code != 0 or silent:
        message = _first_failure(errors, silent, _root_cause(log_path.read_text()))
        raise RuntimeFailure(f"{message} (worker output: {log_path})")
    params = {r: torch.load(run_dir / f"rank_{r}_params.pt", weights_only=True) for r in local}
    return reports, params


def _root_cause(log: str) -> tuple[int, int] | None:
    """(rank, exit code) of torchrun's "Root Cause (first observed failure)", if it printed one."""
    _, found, tail = log.partition("Root Cause")
    if not found:
        return None
    rank = re.search(r"rank\s*:\s*(\d+)", tail)
    code = re.search(r"exitcode\s*:\s*(-?\d+)", tail)
    if rank is None or code is None:
        return None
    return int(rank.group(1)), int(code.group(1))


def _first_failure(errors: dict[int, dict[str, Any]], silent: set[int], root: tuple[int, int] | None = None) -> str:
    """The error of the rank that failed first for a reason of its own, not as an echo of another."""
    primary = sorted((e for e in errors.values() if not e["secondary"]), key=lambda e: e["time"])
    if primary:
        first = primary[0]
        others = len(errors) + len(silent) - 1
        tail = f" ({others} other rank(s) stopped because of it)" if others else ""
        return f"{first['message']}{tail}"
    if root is not None and root[0] not in errors:
        rank, code = root
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return f"rank {rank} {how} without reporting an error (killed, or out of memory?); the other ranks stopped"
    if errors:
        # Only echoes (timeouts, lost peers): the earliest one points at the rank that stopped answering.
        first = sorted(errors.values(), key=lambda e: e["time"])[0]
        return str(first["message"])
    if silent:
        ranks = ", ".join(str(r) for r in sorted(silent))
        return f"rank(s) {ranks} exited without reporting an error (killed by a signal or out of memory?)"
    return "torchrun failed before any rank reported"


# ------------------------------------------------------------------------------- aggregation


def _aggregate(plan: Plan, reports: dict[int, dict[str, Any]], params: dict[int, dict[str, Any]]) -> RunResult:
    per_step: dict[int, dict[int, float]] = {}
    for report in reports.values():
        for step, mbs in report["losses"].items():
            per_step.setdefault(int(step), {}).update({int(m): v for m, v in mbs.items()})
    steps = sorted(per_step)
    losses = []
    for step in steps:
        mbs = per_step[step]
        if len(reports) < plan.ranks:
            continue  # multi-node: the node holding every loss stage replica prints the losses
        if len(mbs) != plan.microbatches:
            raise RuntimeFailure(f"step {step} computed the loss of {len(mbs)} microbatches, not {plan.microbatches}")
        losses.append(sum(mbs[m] for m in sorted(mbs)) / plan.microbatches)
    windows = _step_windows(reports)
    timed = [k for k in windows if k != min(windows)] or list(windows)
    seconds = sum(windows[k][1] - windows[k][0] for k in timed)
    rate = plan.global_batch * len(timed) / seconds if seconds > 0 else 0.0
    timeline = _write_timeline(plan, reports, windows) if windows else None
    return RunResult(
        losses=losses,
        first_step=steps[0] if steps else 0,
        samples_per_s=rate,
        peak_bytes=[int(reports[r]["peak_bytes"]) for r in sorted(reports)],
        devices=[str(reports[r]["device"]) for r in sorted(reports)],
        timeline=timeline,
        params=params,
    )


def _step_windows(reports: dict[int, dict[str, Any]]) -> dict[int, tuple[float, float]]:
    windows: dict[int, tuple[float, float]] = {}
    for report in reports.values():
        for step, (start, end) in report["step_times"].items():
            k = int(step)
            old = windows.get(k, (start, end))
            windows[k] = (min(old[0], start), max(old[1], end))
    return windows


def _write_timeline(plan: Plan, reports: dict[int, dict[str, Any]], windows: dict[int, tuple[float, float]]) -> Path:
    """The last step's spans and memory on every rank, in the simulator's trace format."""

    start, end = windows[max(windows)]
    spans, memory = [], []
    for rank, report in sorted(reports.items()):
        for s in report["spans"]:
            span = Span(**s)
            if start <= span.start_s <= end:
                spans.append(replace(span, start_s=span.start_s - start, end_s=span.end_s - start))
        memory += [MemorySample(rank, t - start, float(b)) for t, b in report["memory"] if start <= t <= end]
    labels = [f"rank {r} · {','.join(reports[r]['stages'])}" for r in sorted(reports)]
    metadata = {"module": plan.module.name, "microbatches": plan.microbatches, "microbatch_size": plan.microbatch_size}
    if plan.module.attrs.schedule:
        metadata["schedule"] = plan.module.attrs.schedule
    timeline = Timeline(plan.ranks, spans, memory, "measured", end - start, labels, metadata)
    path = plan.dir / plan_dir.TIMELINE_MEASURED
    write_trace(timeline, path)
    return path


# ------------------------------------------------------------------------------------- check


def _check(plan: Plan, result: RunResult, optimizer: str, lr: float) -> CheckResult:
    from dapple_ir.backends.torch.reference import train_reference

    ref = train_reference(
        plan.model_spec,
        seed=plan.seed,
        steps=result.first_step + len(result.losses),
        microbatches=plan.microbatches,
        microbatch_size=plan.microbatch_size,
        optimizer=optimizer,
        lr=lr,
    )
    ok = True
    loss_diff = 0.0
    for got, want in zip(result.losses, ref.losses[result.first_step :], strict=True):
        loss_diff = max(loss_diff, abs(got - want))
        ok &= abs(got - want) <= ATOL + RTOL * abs(want)
    param_diff, worst = 0.0, ""
    for rank, tensors in result.params.items():
        for key, value in tensors.items():
            name = key.split("/", 1)[1]
            if name not in ref.params:
                raise RuntimeFailure(f"rank {rank} holds parameter {name} that the reference model does not have")
            want = ref.params[name]
            diff = float((value - want).abs().max()) if value.numel() else 0.0
            if diff >= param_diff:
                param_diff, worst = diff, f"{name} on rank {rank}"
            ok &= torch.allclose(value, want, rtol=RTOL, atol=ATOL)
    return CheckResult(loss_diff, param_diff, worst, bool(ok))
