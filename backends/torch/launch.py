"""`run(plan_dir, steps=...)`: train a plan on as many processes (or threads) as it has ranks.

Two transports: `torchrun` starts `torch.distributed.run` with one worker process per rank (gloo on
CPU, NCCL on CUDA; rendezvous on 127.0.0.1 unless told otherwise, multi-node with `nnodes`,
`node_rank`, `rdzv_endpoint`); `threads` runs every rank as a thread of this process with an
in-process transport (tests, single-GPU machines). Either way each rank reports into a run
directory, and this module aggregates: the loss of every step, samples/s, peak memory per rank, the
measured timeline (`timeline_measured.json`, the simulator's trace format), and with `check=True`
the comparison against single-device training (`_check` says what is compared, and why so).

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
from dapple_ir.backends.torch.random_draws import Site
from dapple_ir.backends.torch.tolerances import ATOL, GRAD_ATOL, NOISE_FLOOR, NORMALISING, RTOL
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


@dataclass
class CheckResult:
    """Pipelined vs single-device training after the same steps (see `_check` for the rule)."""

    max_loss_diff: float
    max_param_diff: float
    worst_param: str
    ok: bool
    max_grad_diff: float = 0.0
    """Largest difference of a gradient of step 0, relative to the largest reference gradient."""
    worst_grad: str = ""
    max_buffer_diff: float = 0.0
    worst_buffer: str = ""
    noise_elements: int = 0
    """Parameter elements compared by gradient only (noise-level gradient under Adam or AdamW)."""
    averaged_buffers: int = 0
    """Buffers of replicated stages: averaged over replicas (checked equal there), not compared to the reference."""
    failures: list[str] = field(default_factory=list)
    """What differs beyond tolerance, one line each (the first few)."""
    notes: list[str] = field(default_factory=list)
    """What may explain the failures (where the runs part, a model that amplifies rounding)."""


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
    buffers: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)
    """Final buffers per rank, `stage/name` keys."""
    grads: dict[int, dict[int, dict[str, torch.Tensor]]] = field(default_factory=dict, repr=False)
    """With `check`: per rank, by step (step 0 only), the gradients the optimizer saw (`stage/name` keys)."""
    sites: list[Site] = field(default_factory=list, repr=False)
    """The random draws of one microbatch's forward, every stage's, in graph order."""
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
        check=check,
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
    # spinning pools on a busy machine run many times slower than a single thread each. The reference
    # runs with the ranks' thread count too: CPU kernels then split their sums alike and round alike.
    threads = max(1, (os.cpu_count() or 1) // plan.ranks) if transport == "threads" else _worker_threads()
    with _intra_op_threads(threads):
        if transport == "threads":
            reports, states = _run_threads(plan, options)
        else:
            reports, states = _run_torchrun(plan, options, nnodes, node_rank, rdzv_endpoint)
        result = _aggregate(plan, reports, states)
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


def _worker_threads() -> int:
    """Intra-op threads of a torchrun worker (`_run_torchrun` passes OMP_NUM_THREADS, 1 unless set)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


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
    states = {r: torch.load(run_dir / f"rank_{r}_params.pt", weights_only=True) for r in local}
    return reports, states


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


def _aggregate(plan: Plan, reports: dict[int, dict[str, Any]], states: dict[int, dict[str, Any]]) -> RunResult:
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
        params={r: state["params"] for r, state in states.items()},
        buffers={r: state["buffers"] for r, state in states.items()},
        grads={r: state["grads"] for r, state in states.items()},
        sites=_sites_in_graph_order(plan, states),
    )


def _sites_in_graph_order(plan: Plan, states: dict[int, dict[str, Any]]) -> list[Site]:
    """Every stage's random draws (replicas report the same), ordered as the model's ops run."""
    order = {op.name: i for i, op in enumerate(plan.module.ops)}
    sites: set[Site] = set()
    for state in states.values():
        for stage, drawn in state["sites"].items():
            for op, index in drawn:
                if op not in order:
                    raise RuntimeFailure(f"stage @{stage} drew random numbers in %{op}, an op the plan does not have")
                sites.add((op, int(index)))
    return sorted(sites, key=lambda site: (order[site[0]], site[1]))


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
    """Train the reference and compare what is meaningful (the rule `dapple run --help` states):

    - the loss of every step run, within ATOL + RTOL of the reference's;
    - every parameter copy's gradient at step 0, where both start from the same parameters (what the
      pipeline computes; the optimizer is the same code on both sides), within RTOL of the element plus
      GRAD_ATOL of the step's largest (later gradients follow the parameters, which the next items check);
    - every parameter copy after the last step, within ATOL + RTOL, except under Adam and AdamW the
      elements whose reference gradient was at noise level (NOISE_FLOOR) in some step: their
      gradients were compared, and their steps are noise normalised to the learning rate;
    - buffers of unreplicated stages like parameters; a replicated stage's buffers are averaged over
      its replicas (its microbatches are not run in one sequence), so they must agree across them.
    """
    from dapple_ir.backends.torch.reference import train_reference

    ref = train_reference(
        plan.model_spec,
        seed=plan.seed,
        steps=result.first_step + len(result.losses),
        microbatches=plan.microbatches,
        microbatch_size=plan.microbatch_size,
        optimizer=optimizer,
        lr=lr,
        sites=result.sites,
    )
    scales = [max((float(g.abs().max()) for g in step.values() if g.numel()), default=0.0) for step in ref.grads]
    failures: list[str] = []
    bad_steps: set[int] = set()
    loss = _Worst()
    for step, (got, want) in enumerate(
        zip(result.losses, ref.losses[result.first_step :], strict=True), result.first_step
    ):
        loss.add(abs(got - want), f"step {step}")
        if abs(got - want) > ATOL + RTOL * abs(want):
            failures.append(f"loss of step {step}: {got:.7g}, the reference {want:.7g}")
            bad_steps.add(step)
    grad = _compare_grads(result, ref.grads, scales, failures, bad_steps)
    noisy = _noise_masks(ref.grads, scales) if optimizer in NORMALISING else {}
    param = _Worst()
    for rank, tensors in result.params.items():
        for key, value in tensors.items():
            name = key.split("/", 1)[1]
            if name not in ref.params:
                raise RuntimeFailure(f"rank {rank} holds parameter {name} that the reference model does not have")
            mask = noisy.get(name)
            _compare(value, ref.params[name], mask, f"parameter {name} on rank {rank}", param, failures)
    buffer, averaged = _compare_buffers(plan, result, ref.buffers, failures)
    return CheckResult(
        max_loss_diff=loss.diff,
        max_param_diff=param.diff,
        worst_param=param.where,
        ok=not failures,
        max_grad_diff=grad.diff,
        worst_grad=grad.where,
        max_buffer_diff=buffer.diff,
        worst_buffer=buffer.where,
        noise_elements=sum(int(m.sum()) for m in noisy.values()),
        averaged_buffers=averaged,
        failures=failures[:_SHOWN] + ([f"... and {len(failures) - _SHOWN} more"] if len(failures) > _SHOWN else []),
        notes=_notes(result, ref.batch_norm_values, bad_steps) if failures else [],
    )


#: Batch norm over at most this many values per channel is noted as a likely amplifier of rounding.
_FEW_VALUES = 32


def _notes(result: RunResult, batch_norm_values: dict[str, int], bad_steps: set[int]) -> list[str]:
    """Hints for a failed check: whether the first step agreed, and batch norms that amplify rounding."""
    notes = []
    if result.grads and result.first_step == 0 and 0 not in bad_steps:
        notes.append(
            "the first step agrees (its loss and every gradient), the runs part after it: either training "
            "amplifies rounding differences, or something after the first optimizer step differs (optimizer "
            "state, zeroing of gradients)"
        )
    few = sorted((count, name) for name, count in batch_norm_values.items() if count <= _FEW_VALUES)
    if few:
        count, name = few[0]
        notes.append(
            f"batch norm {name} normalises over only {count} value(s) per channel (microbatch size x spatial "
            "size): near ties its gradient grows like 1/sqrt(eps), amplifying rounding (a replicated stage sums "
            "microbatch gradients in another order than one device) into a different training; use larger "
            "microbatches, fewer replicas or GroupNorm where runs must agree exactly"
        )
    return notes


#: Failures listed in a check's report; the rest are counted.
_SHOWN = 5


@dataclass
class _Worst:
    """The largest difference seen so far and where."""

    diff: float = 0.0
    where: str = ""

    def add(self, diff: float, where: str) -> None:
        if diff > self.diff or not self.where:
            self.diff, self.where = diff, where


def _compare_grads(
    result: RunResult,
    ref_grads: list[dict[str, torch.Tensor]],
    scales: list[float],
    failures: list[str],
    bad_steps: set[int],
) -> _Worst:
    worst = _Worst()
    for rank, steps in result.grads.items():
        for step, grads in sorted(steps.items()):
            scale = scales[step]
            for key, value in grads.items():
                name = key.split("/", 1)[1]
                if name not in ref_grads[step]:
                    continue  # the parameter comparison names it
                want = ref_grads[step][name]
                diff = (value - want).abs()
                where = f"gradient of {name} on rank {rank} at step {step}"
                worst.add(float(diff.max()) / scale if scale > 0 and diff.numel() else 0.0, where)
                if bool((diff > RTOL * want.abs() + GRAD_ATOL * scale).any()):
                    bad_steps.add(step)
                    failures.append(
                        f"{where}: max |diff| {float(diff.max()):.3g}, allowed {RTOL:g} of the element plus "
                        f"{GRAD_ATOL * scale:.3g} ({GRAD_ATOL:g} of the step's largest gradient, {scale:.3g})"
                    )
    return worst


def _noise_masks(ref_grads: list[dict[str, torch.Tensor]], scales: list[float]) -> dict[str, torch.Tensor]:
    """Per parameter, the elements whose reference gradient was at noise level in some step."""
    masks: dict[str, torch.Tensor] = {}
    for grads, scale in zip(ref_grads, scales, strict=True):
        for name, g in grads.items():
            low = g.abs() <= NOISE_FLOOR * scale
            masks[name] = masks[name] | low if name in masks else low
    return masks


def _compare(
    got: torch.Tensor, want: torch.Tensor, skip: torch.Tensor | None, where: str, worst: _Worst, failures: list[str]
) -> None:
    """Elementwise within ATOL + RTOL (integers exactly), leaving out the elements `skip` marks."""
    if got.shape != want.shape:
        failures.append(f"{where}: shape {tuple(got.shape)}, the reference {tuple(want.shape)}")
        return
    if not got.is_floating_point():
        worst.add(0.0 if torch.equal(got, want) else float("inf"), where)
        if not torch.equal(got, want):
            failures.append(f"{where}: {got.tolist()}, the reference {want.tolist()}")
        return
    diff = (got - want).abs()
    bad = diff > ATOL + RTOL * want.abs()
    if skip is not None:
        diff, bad = diff.masked_fill(skip, 0.0), bad & ~skip
    worst.add(float(diff.max()) if diff.numel() else 0.0, where)
    if bool(bad.any()):
        failures.append(f"{where}: max |diff| {float(diff.max()):.3g} in {int(bad.sum())} element(s)")


def _compare_buffers(
    plan: Plan, result: RunResult, ref_buffers: dict[str, torch.Tensor], failures: list[str]
) -> tuple[_Worst, int]:
    """Unreplicated stages' buffers against the reference; replicated stages' across their replicas."""
    replicas = {stage.name: stage.attrs.replicas or 1 for stage in plan.module.stages}
    worst = _Worst()
    copies: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for rank, tensors in result.buffers.items():
        for key, value in tensors.items():
            stage, name = key.split("/", 1)
            if name not in ref_buffers:
                continue  # a constant of the graph (export lifts some), not state of the model
            if replicas.get(stage, 1) > 1:
                copies.setdefault(key, []).append((rank, value))
            else:
                _compare(value, ref_buffers[name], None, f"buffer {name} on rank {rank}", worst, failures)
    for key, held in copies.items():
        first_rank, first = held[0]
        for rank, value in held[1:]:
            if not torch.equal(value, first):
                stage, name = key.split("/", 1)
                failures.append(f"buffer {name} differs between replicas of @{stage} (ranks {first_rank} and {rank})")
    return worst, len(copies)
