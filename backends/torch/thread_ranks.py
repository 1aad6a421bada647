"""The threads transport: every rank a thread of this process, talking through an in-process hub.

For tests and single-GPU machines. A failing rank fails the hub, so the others' next waits fail too
and the run ends with the first failure named; a signal fails every rank's waits the same way.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from dapple_ir.backends.torch.failure_report import first_failure
from dapple_ir.backends.torch.stop_signals import Signalled
from dapple_ir.backends.torch.transport import ThreadHub, ThreadTransport
from dapple_ir.backends.torch.watchdog import WATCHDOG_SLACK_S, join_while_progressing
from dapple_ir.backends.torch.worker import (
    RunOptions,
    build_runtime,
    error_report,
    final_params,
    prepare_model,
    train_rank,
)
from dapple_ir.errors import DappleError, RuntimeFailure
from dapple_ir.plan_dir import Plan


def run_threads(plan: Plan, options: RunOptions) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """Train every rank as a thread of this process: (their reports, their final states) by rank."""
    if options.device == "cuda" and any(stage.tp > 1 for stage in plan.module.stages):
        # CUDA runs every thread's backward on one autograd device thread: a member blocked in its tensor
        # group's sum there would keep the other members' backwards from ever reaching theirs.
        raise DappleError(
            "the threads transport cannot run tensor-parallel stages (tp > 1) on CUDA: one autograd thread runs "
            "every rank's backward; use --transport torchrun (one process per rank), or the CPU"
        )
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
    # Every wait inside is bounded by the timeout; this join only guards against a stuck compute.
    try:
        stuck = join_while_progressing(threads, runtimes, options.timeout + WATCHDOG_SLACK_S)
    except Signalled:
        for rank in range(plan.ranks):  # their next wait fails, so no rank trains on behind the caller's back
            hub.fail(rank, f"rank {rank}: the run was stopped by a signal")
        raise
    if stuck and not errors:
        raise RuntimeFailure(
            f"rank(s) {stuck} made no progress for {options.timeout + WATCHDOG_SLACK_S:g} s; a compute call is stuck"
        )
    if errors:
        raise RuntimeFailure(first_failure(errors, set(range(plan.ranks)) - set(reports) - set(errors)))
    return reports, {r: final_params(rt) for r, rt in enumerate(runtimes)}
