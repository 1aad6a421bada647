"""`run(plan_dir, steps=...)`: train a plan on as many processes (or threads) as it has ranks.

Two transports: `torchrun` starts `torch.distributed.run` with one worker process per rank (gloo on
CPU, NCCL on CUDA; rendezvous on 127.0.0.1 unless told otherwise, multi-node with `nnodes`,
`node_rank`, `rdzv_endpoint`: `torchrun.py`, `rendezvous.py`); `threads` runs every rank as a thread of
this process with an in-process transport (tests, single-GPU machines: `thread_ranks.py`). Either way
each rank reports into a run directory, and `results.py` aggregates: the loss of every step, samples/s,
peak memory per rank, the measured timeline (`timeline_measured.json`, the simulator's trace format);
with `check=True` `check.py` compares against single-device training (`compare_with_reference` says
what is compared, and why so).

A failing rank writes its error and stops; the others stop within the timeout (their waits are
bounded, the watchdog and torchrun end the group: `watchdog.py`), and `run` raises `RuntimeFailure`
with the first failing rank's message, not the echoes of the others (`failure_report.py`). SIGINT and
SIGTERM stop every process of the run (`stop_signals.py`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from dapple_ir.backends.torch.check import compare_with_reference
from dapple_ir.backends.torch.failure_report import first_failure
from dapple_ir.backends.torch.rendezvous import free_port, resolve_endpoint
from dapple_ir.backends.torch.results import CheckResult, RunResult, aggregate, cpu_wait
from dapple_ir.backends.torch.stop_signals import Interrupted, stoppable
from dapple_ir.backends.torch.thread_ranks import run_threads
from dapple_ir.backends.torch.tolerances import ATOL, RTOL
from dapple_ir.backends.torch.torchrun import check_torchrun_can_start, run_torchrun
from dapple_ir.backends.torch.watchdog import STOP_GRACE_S, WATCHDOG_SLACK_S
from dapple_ir.backends.torch.worker import RunOptions, check_checkpoints, check_rank_file, resolve_optimizer
from dapple_ir.errors import DappleError
from dapple_ir.plan_dir import RUN_DIR, RUN_FILES, Plan, load_plan

#: What callers import from here: `run` and what it returns and raises, and names kept importable from here
#: since the launcher was one module (`dapple_ir.commands.run`, the tests).
__all__ = [
    "ATOL",
    "RTOL",
    "STOP_GRACE_S",
    "WATCHDOG_SLACK_S",
    "CheckResult",
    "Interrupted",
    "RunResult",
    "_cpu_wait",
    "_first_failure",
    "free_port",
    "run",
]
_cpu_wait, _first_failure = cpu_wait, first_failure


@stoppable
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
    listen_host: str | None = None,
    save_every: int | None = None,
    pin: bool = True,
) -> RunResult:
    """Train the plan in `plan_dir` for `steps` optimizer steps; see the module docstring.

    `listen_host` is the address the rendezvous store and the ranks' sockets bind: loopback by default,
    with `rdzv_endpoint` the address this machine reaches the endpoint from. SIGINT or SIGTERM stops
    every process of the run and raises `Interrupted`. `pin`: under torchrun, each CPU rank runs on cores of its
    own where the node has a core for every rank (`cores.pin_rank`).
    """
    if steps < 1:
        raise DappleError(f"steps must be at least 1, not {steps}")
    plan = load_plan(plan_dir)
    _refuse_bad_launch(plan, transport, nnodes, node_rank, check, rdzv_endpoint, listen_host)
    opt, rate = resolve_optimizer(plan, optimizer, lr)
    out = Path(run_dir) if run_dir is not None else plan.dir / RUN_DIR
    options = RunOptions(
        steps=steps,
        optimizer=opt,
        lr=rate,
        timeout=timeout,
        run_dir=str(out),
        save=str(save) if save is not None else None,
        resume=str(resume) if resume is not None else None,
        device=_pick_device(device, transport, plan.ranks // nnodes),
        check=check,
        save_every=save_every,
        pin_cores=pin,
    )
    for rank in range(plan.ranks):
        check_rank_file(plan, rank)  # refuse a stale or edited rank file before starting any process
    check_checkpoints(plan, options)  # an unwritable --save or a bad --resume, before anything trains
    if transport == "torchrun":
        check_torchrun_can_start()
        endpoint = resolve_endpoint(rdzv_endpoint, listen_host)
    _clean(out)  # only now: a refused run leaves the last run's reports as they were
    # Threads share this process's cores: one intra-op pool per rank would oversubscribe them, and
    # spinning pools on a busy machine run many times slower than a single thread each. The reference
    # runs with the ranks' thread count too: CPU kernels then split their sums alike and round alike.
    threads = max(1, (os.cpu_count() or 1) // plan.ranks) if transport == "threads" else _worker_threads()
    with _intra_op_threads(threads):
        if transport == "threads":
            reports, states = run_threads(plan, options)
        else:
            reports, states = run_torchrun(plan, options, nnodes, node_rank, endpoint)
        result = aggregate(plan, reports, states)
        if check:
            result.check = compare_with_reference(plan, result, opt, rate)
    return result


def _refuse_bad_launch(
    plan: Plan,
    transport: str,
    nnodes: int,
    node_rank: int,
    check: bool,
    rdzv_endpoint: str | None,
    listen_host: str | None,
) -> None:
    """Refuse, before anything starts, where and how to run that cannot work: each would otherwise start torchrun
    and end only when the watchdog gave up on a rendezvous no node can complete, or train the plan twice."""
    if transport not in ("threads", "torchrun"):
        raise DappleError(f"unknown transport '{transport}'; choose torchrun or threads")
    if nnodes < 1 or plan.ranks % nnodes:
        raise DappleError(f"the plan's {plan.ranks} ranks do not divide evenly over {nnodes} nodes")
    if not 0 <= node_rank < nnodes:
        raise DappleError(
            f"node rank {node_rank} is not a node of this run: the node rank must be at least 0 and less than the "
            f"node count, and the plan's {plan.ranks} ranks run on {nnodes} node(s) (--nnodes {nnodes}), numbered "
            f"0 to {nnodes - 1}; give each node its own --node-rank, or --nnodes as many as take part"
        )
    torchrun_only = [
        flag
        for flag, given in (
            (f"--nnodes {nnodes}", nnodes > 1),
            (f"--rdzv-endpoint {rdzv_endpoint}", bool(rdzv_endpoint)),
            (f"--listen-host {listen_host}", bool(listen_host)),
        )
        if given
    ]
    if transport == "threads" and torchrun_only:
        raise DappleError(
            f"--transport threads runs every rank as a thread of this process, on this machine, so "
            f"{', '.join(torchrun_only)} has no meaning there; leave it out, or use --transport torchrun"
        )
    if nnodes > 1 and not rdzv_endpoint:
        raise DappleError(
            f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node: without it node 0's "
            "rendezvous listens on loopback at a port of its choosing, where no other node can reach it"
        )
    if check and nnodes > 1:
        raise DappleError("--check compares every rank's parameters, so it needs all ranks on one node (nnodes = 1)")


@contextmanager
def _intra_op_threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _worker_threads() -> int:
    """Intra-op threads of a torchrun worker (`run_torchrun` passes OMP_NUM_THREADS, 1 unless set)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


def _pick_device(device: str, transport: str, per_node: int) -> str:
    if device == "cuda" and not torch.cuda.is_available():
        raise DappleError("device cuda was asked for but torch sees no CUDA device")
    if device == "cuda" and transport == "torchrun" and torch.cuda.device_count() < per_node:
        # Each torchrun worker takes the GPU of its local rank: one past the last would fail in every such rank.
        raise DappleError(
            f"device cuda under torchrun gives each of this node's {per_node} ranks a GPU of its own, but torch "
            f"sees {torch.cuda.device_count()} CUDA device(s) here; run the plan on more nodes (--nnodes), on the "
            "CPU (--device cpu), or in one process (--transport threads)"
        )
    if device in ("cpu", "cuda"):
        return device
    if device != "auto":
        raise DappleError(f"unknown device '{device}'; choose auto, cpu or cuda")
    if not torch.cuda.is_available():
        return "cpu"
    return "cuda" if transport == "threads" or torch.cuda.device_count() >= per_node else "cpu"


def _clean(run_dir: Path) -> None:
    """Remove an earlier run's reports (only the files ranks write), so none is mistaken for this run's."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for pattern in RUN_FILES:
        for stale in run_dir.glob(pattern):
            stale.unlink()
