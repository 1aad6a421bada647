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

import contextlib
import errno
import functools
import json
import math
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from dapple_ir import plan_dir
from dapple_ir.backends.torch.random_draws import Site
from dapple_ir.backends.torch.runtime import Runtime
from dapple_ir.backends.torch.tolerances import ATOL, GRAD_ATOL, NOISE_FLOOR, NORMALISING, RTOL
from dapple_ir.backends.torch.transport import ThreadHub, ThreadTransport
from dapple_ir.backends.torch.worker import (
    PARENT_PID_ENV,
    RunOptions,
    build_runtime,
    check_checkpoints,
    check_rank_file,
    die_with_parent,
    error_report,
    final_params,
    heartbeat_file,
    heartbeat_interval,
    prepare_model,
    resolve_optimizer,
    train_rank,
    worker_flags,
)
from dapple_ir.errors import DappleError, RuntimeFailure
from dapple_ir.plan_dir import RUN_DIR, RUN_FILES, Plan, load_plan
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
    cpu_waits: list[float | None] = field(default_factory=list)
    """Per rank, the share of the timed steps it spent runnable but waiting for a CPU (`Span.queued_s`); None
    where the system does not say. Large where ranks outnumber the cores they share."""
    step_s: list[float] = field(default_factory=list)
    """Each step run, in order: seconds from the end of the one before (every rank done) to its own end; the first
    from its start. The steady step is the median past the first few (they warm caches and allocators up)."""
    cores: list[list[int] | None] = field(default_factory=list)
    """Per rank, the CPU cores it was pinned to (`cores.pin_rank`); None where it was not (CUDA, threads, `pin`
    off, fewer cores than ranks on its node)."""


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _stoppable(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """`fn` with SIGINT and SIGTERM raising `Interrupted` (after `_run_torchrun` stopped its processes)."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with _signals_raise():
            try:
                return fn(*args, **kwargs)
            except _Signalled as sig:  # before torchrun started, or under threads (they end with this process)
                name = signal.Signals(sig.signum).name
                raise Interrupted(sig.signum, f"stopped by {name}; no rank process had started") from None

    return wrapper


@_stoppable
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
    opt, rate = resolve_optimizer(plan, optimizer, lr)
    out = Path(run_dir) if run_dir is not None else plan.dir / RUN_DIR
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
        save_every=save_every,
        pin_cores=pin,
    )
    if transport not in ("threads", "torchrun"):
        raise DappleError(f"unknown transport '{transport}'; choose torchrun or threads")
    if nnodes < 1 or plan.ranks % nnodes:
        raise DappleError(f"the plan's {plan.ranks} ranks do not divide evenly over {nnodes} nodes")
    if check and nnodes > 1:
        raise DappleError("--check compares every rank's parameters, so it needs all ranks on one node (nnodes = 1)")
    for rank in range(plan.ranks):
        check_rank_file(plan, rank)  # refuse a stale or edited rank file before starting any process
    check_checkpoints(plan, options)  # an unwritable --save or a bad --resume, before anything trains
    if transport == "torchrun":
        _check_torchrun_can_start()
        endpoint = resolve_endpoint(rdzv_endpoint, listen_host)
    # Threads share this process's cores: one intra-op pool per rank would oversubscribe them, and
    # spinning pools on a busy machine run many times slower than a single thread each. The reference
    # runs with the ranks' thread count too: CPU kernels then split their sums alike and round alike.
    threads = max(1, (os.cpu_count() or 1) // plan.ranks) if transport == "threads" else _worker_threads()
    with _intra_op_threads(threads):
        if transport == "threads":
            reports, states = _run_threads(plan, options)
        else:
            reports, states = _run_torchrun(plan, options, nnodes, node_rank, endpoint)
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
    for pattern in RUN_FILES:
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
    # Every wait inside is bounded by the timeout; this join only guards against a stuck compute.
    try:
        stuck = _join_while_progressing(threads, runtimes, options.timeout + WATCHDOG_SLACK_S)
    except _Signalled:
        for rank in range(plan.ranks):  # their next wait fails, so no rank trains on behind the caller's back
            hub.fail(rank, f"rank {rank}: the run was stopped by a signal")
        raise
    if stuck and not errors:
        raise RuntimeFailure(
            f"rank(s) {stuck} made no progress for {options.timeout + WATCHDOG_SLACK_S:g} s; a compute call is stuck"
        )
    if errors:
        raise RuntimeFailure(_first_failure(errors, set(range(plan.ranks)) - set(reports) - set(errors)))
    return reports, {r: final_params(rt) for r, rt in enumerate(runtimes)}


def _join_while_progressing(threads: list[threading.Thread], runtimes: list[Runtime], bound: float) -> list[int]:
    """Join the rank threads, giving up once no rank has completed an instruction for `bound` seconds."""
    last: list[int] = []
    moved = time.monotonic()
    while alive := [t for t in threads if t.is_alive()]:
        progress = [rt.step + len(rt.spans) for rt in runtimes]
        if progress != last:
            last, moved = progress, time.monotonic()
        elif time.monotonic() - moved > bound:
            break
        alive[0].join(_POLL_S)
    return [r for r, t in enumerate(threads) if t.is_alive()]


# ------------------------------------------------------------------------------------ torchrun

#: Seconds the watchdog allows beyond `timeout` without progress, so that a rank's own bounded wait,
#: which names what it waited for, reports first.
WATCHDOG_SLACK_S = 5.0
#: Seconds a rank may spend preparing (capturing the model, joining the process group) beyond `timeout`.
PREPARE_S = 300.0
#: Seconds torchrun and its workers may take to start (interpreter, torch import) before the first heartbeat.
START_S = 60.0
#: Seconds torchrun and the workers get to end once told to stop (or once a rank failed), before SIGKILL.
STOP_GRACE_S = 5.0
#: Seconds between two looks of the launcher at torchrun and the heartbeats.
_POLL_S = 0.1


class Interrupted(RuntimeFailure):
    """The run was stopped by SIGINT or SIGTERM; `status` is the exit status to end with (128 + signal)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.status = 128 + signum


class _Signalled(BaseException):
    """Raised in the main thread by SIGINT or SIGTERM while `run` lasts (see `_signals_raise`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _signals_raise() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into `_Signalled` while the run lasts, so that it can stop what it started."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; a run in another thread leaves them alone
        return

    def handler(signum: int, frame: Any) -> None:
        raise _Signalled(signum)

    before = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _hold_signals() -> None:
    """Ignore SIGINT and SIGTERM until `_signals_raise` restores the handlers."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _check_torchrun_can_start() -> None:
    if not torch.distributed.is_available():
        raise DappleError(
            f"this torch build ({torch.__version__}) has no torch.distributed, so torchrun cannot start "
            "the ranks; install a torch build with distributed support, or run all ranks in one process "
            "with --transport threads"
        )


@dataclass
class Endpoint:
    """Where the rendezvous store listens (`host`:`port`) and which address this node's listeners bind."""

    host: str
    port: int
    listen_host: str
    given: bool
    """Whether the user gave the endpoint (`--rdzv-endpoint`): c10d rendezvous, else static on loopback."""

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def resolve_endpoint(rdzv_endpoint: str | None, listen_host: str | None) -> Endpoint:
    """The rendezvous endpoint and listen address of a run (loopback unless told otherwise)."""
    if not rdzv_endpoint:
        return Endpoint("127.0.0.1", 0, listen_host or "127.0.0.1", False)
    host, _, port = rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DappleError(f"rendezvous endpoint '{rdzv_endpoint}' is not HOST:PORT (a port from 1 to 65535)")
    return Endpoint(host, int(port), listen_host or _address_towards(host, int(port)), True)


def _address_towards(host: str, port: int) -> str:
    """The address of this machine that packets to `host` leave from: where the other nodes reach it."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP: chooses a route, sends nothing
            return str(s.getsockname()[0])
    except OSError as exc:
        raise DappleError(
            f"cannot reach the rendezvous host {host} ({exc.strerror or exc}); check --rdzv-endpoint, or give "
            "the address to listen on with --listen-host"
        ) from None


def _listen(endpoint: Endpoint) -> socket.socket:
    """Node 0's rendezvous store socket, bound and listening before any process starts (no port race)."""
    try:
        infos = socket.getaddrinfo(endpoint.listen_host, endpoint.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise DappleError(f"listen host '{endpoint.listen_host}' does not resolve ({exc.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise DappleError(
                f"port {endpoint.port} of the rendezvous endpoint {endpoint} is already in use on "
                f"{endpoint.listen_host} (another run or program holds it); pick another port, or leave out "
                "--rdzv-endpoint to use a free one on loopback"
            ) from None
        raise DappleError(
            f"cannot listen on {endpoint.listen_host}:{endpoint.port} for the rendezvous ({exc.strerror}): "
            "is it an address of this machine? Give one with --listen-host"
        ) from None
    return sock


def torchrun_command(plan: Plan, options: RunOptions, nnodes: int, node_rank: int, endpoint: Endpoint) -> list[str]:
    """The torchrun command line that `run` starts (one worker process per local rank).

    It runs `torchrun_main` (torchrun tied to this process, its store on the socket `_listen` bound).
    """
    command = [
        sys.executable,
        "-c",
        "from dapple_ir.backends.torch.launch import torchrun_main; torchrun_main()",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={plan.ranks // nnodes}",
        f"--node-rank={node_rank}",
        "--max-restarts=0",
        "--monitor-interval=0.1",
        f"--local-addr={endpoint.listen_host}",
    ]
    if endpoint.given:
        # Bounded joins; node 0 hosts the store (on the socket bound by `_listen`), the others dial it.
        wait = max(1, math.ceil(options.timeout))
        conf = f"join_timeout={wait},read_timeout={wait},last_call_timeout=1,is_host={int(node_rank == 0)}"
        command += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=dapple", f"--rdzv-conf={conf}"]
    else:
        command += [f"--master-addr={endpoint.host}", f"--master-port={endpoint.port}"]
    command += ["-m", "dapple_ir.backends.torch.worker", str(plan.dir), *worker_flags(options)]
    return command


#: Environment variables that carry the store socket and listen address from the launcher to torchrun.
_STORE_FD_ENV, _LISTEN_ENV = "DAPPLE_STORE_FD", "DAPPLE_LISTEN_HOST"


def torchrun_main() -> None:
    """The torchrun process of a run: dies with its launcher, keeps every listener where the launcher says.

    torch's TCPStore server binds every interface whatever host it is given; only one started on a
    socket that is already bound (`master_listen_fd`) stays on its address. So this process hosts the
    rendezvous store on the launcher's socket before torchrun starts; torchrun's own store joins it
    (`multi_tenant`, one server per port). Under c10d rendezvous the agent that becomes rank 0 starts
    a second store for the workers on a free port: it too is given a socket bound to the listen address.
    """
    die_with_parent(signal.SIGTERM)  # SIGTERM: torchrun's handler stops its workers before it exits
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # the workers tie themselves to this process
    listen_host = os.environ.pop(_LISTEN_ENV, "127.0.0.1")
    stores: list[Any] = []
    fd = os.environ.pop(_STORE_FD_ENV, None)
    if fd is not None:
        sock = socket.socket(fileno=int(fd))
        host, port = sock.getsockname()[:2]
        stores.append((sock, _store_on(sock, host, port)))

    def shared_store_server(handler: Any, master_addr: str, master_port: int) -> Any:
        sock = socket.create_server((listen_host, master_port), backlog=128)
        store = _store_on(sock, master_addr, int(sock.getsockname()[1]))
        stores.append((sock, store))
        return store

    DynamicRendezvousHandler._create_tcp_store_server = shared_store_server  # type: ignore[method-assign,assignment]
    sys.argv = ["torchrun", *sys.argv[1:]]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


def _store_on(sock: socket.socket, host: str, port: int) -> Any:
    return torch.distributed.TCPStore(
        host, port, None, True, wait_for_workers=False, multi_tenant=True, master_listen_fd=sock.fileno()
    )


def _torchrun_env(endpoint: Endpoint, sock: socket.socket | None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env[PARENT_PID_ENV] = str(os.getpid())
    env[_LISTEN_ENV] = endpoint.listen_host
    if sock is not None:
        env[_STORE_FD_ENV] = str(sock.fileno())
    loopback = _loopback_interface()
    if _is_loopback(endpoint.listen_host) and loopback:
        # gloo's and NCCL's own sockets (one pair per peer) on loopback too; a user's choice stands.
        env.setdefault("GLOO_SOCKET_IFNAME", loopback)
        env.setdefault("NCCL_SOCKET_IFNAME", loopback)
    return env


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return min(names, key=len) if names else None


def _run_torchrun(
    plan: Plan, options: RunOptions, nnodes: int, node_rank: int, endpoint: Endpoint
) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    run_dir = Path(options.run_dir)
    log_path = run_dir / "torchrun.log"
    per_node = plan.ranks // nnodes
    local = range(node_rank * per_node, (node_rank + 1) * per_node)
    sock = _listen(endpoint) if node_rank == 0 else None
    if sock is not None:
        endpoint = replace(endpoint, port=int(sock.getsockname()[1]))
    try:
        command = torchrun_command(plan, options, nnodes, node_rank, endpoint)
        env = _torchrun_env(endpoint, sock)
        with log_path.open("w") as log:
            # A session of its own: a terminal's Ctrl-C reaches this process only, which stops the rest.
            proc = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                pass_fds=(sock.fileno(),) if sock is not None else (),
            )
    finally:
        if sock is not None:
            sock.close()  # torchrun holds its own copy
    watch = _Watch(proc, run_dir, local, options.timeout, endpoint)
    try:
        code = watch.wait()
    except _Signalled as sig:
        _hold_signals()  # a second Ctrl-C must not cut the stop short; it is bounded anyway
        name = signal.Signals(sig.signum).name
        print(f"dapple run: {name} received, stopping torchrun and the ranks", file=sys.stderr, flush=True)
        stopped = watch.stop()
        raise Interrupted(sig.signum, f"stopped by {name}: {stopped}") from None
    except BaseException:
        watch.stop()  # whatever went wrong here, no process of the run outlives it
        raise
    # c10d rendezvous numbers the nodes as they join, not by --node-rank: on several nodes the ranks are
    # those of this torchrun's workers, as their heartbeats say (the node_rank range if none was seen).
    ours = sorted(watch.beats) if nnodes > 1 and watch.beats else list(local)
    errors = _read_reports(run_dir, "error_rank_{}.json", ours)
    reports = _read_reports(run_dir, "rank_{}.json", ours)
    silent = set(ours) - set(reports) - set(errors)
    if errors or code != 0 or silent or watch.verdict:
        output = log_path.read_text()
        primary = any(not e["secondary"] for e in errors.values())
        if watch.verdict and not primary and not watch.suspects:
            message = watch.verdict  # a stuck rank, or no rank at all: nothing else knows more
        else:
            message = _first_failure(errors, silent, _root_cause(output), watch.suspects)
        if not (errors or reports or watch.verdict or any(run_dir.glob(heartbeat_file("*")))):
            message = f"torchrun ended before any rank started: {_rendezvous_error(output, endpoint)}"
        if watch.stopped:
            message += f"; the launcher stopped what was left: {watch.stopped}"
        raise RuntimeFailure(f"{message} (worker output: {log_path})")
    states = {r: torch.load(run_dir / f"rank_{r}_params.pt", weights_only=True) for r in ours}
    return reports, states


def _read_reports(run_dir: Path, pattern: str, ranks: list[int]) -> dict[int, dict[str, Any]]:
    found = {}
    for rank in ranks:
        path = run_dir / pattern.format(rank)
        if path.is_file():
            found[rank] = json.loads(path.read_text())
    return found


class _Watch:
    """Waits for torchrun with bounds that do not grow with the steps, from the ranks' heartbeats.

    A rank whose progress (`Heartbeat`) has not moved for `timeout` + slack (`PREPARE_S` more while it
    prepares), no rank started within `START_S` + slack (the rendezvous did not complete), or processes
    that linger `STOP_GRACE_S` after a rank failed: the watchdog stops everything itself and says why.
    """

    def __init__(self, proc: subprocess.Popen[bytes], run_dir: Path, ranks: range, timeout: float, endpoint: Endpoint):
        self.proc = proc
        self.run_dir = run_dir
        self.ranks = ranks
        self.timeout = timeout
        self.endpoint = endpoint
        self.beats: dict[int, dict[str, Any]] = {}
        self.moved: dict[int, float] = {}
        """Per rank, when (monotonic) its phase, step or progress last changed."""
        self.verdict = ""
        """Why the watchdog stopped the run ('' when it did not)."""
        self.started = time.monotonic()
        self.suspects: dict[int, str] = {}
        """Ranks found stopped or frozen when the watchdog stepped in (`frozen`)."""
        self.started_at: dict[int, str] = {}
        """Start time (/proc stat field 22) of each worker pid of this run."""
        self.stopped = ""
        """What the launcher itself had to stop (`stop`), '' when torchrun ended on its own."""

    def wait(self) -> int:
        failed_at: float | None = None
        while (code := self.proc.poll()) is None:
            now = time.monotonic()
            self._read(now)
            if failed_at is None and any(self.run_dir.glob("error_rank_*.json")):
                failed_at = now
            if failed_at is not None and now - failed_at > STOP_GRACE_S:
                # A rank failed and reported why; the rest lingers (a stopped or stuck process): end it.
                self.suspects = self.frozen()
                self.stopped = self.stop()
                return self.proc.returncode
            stall = self._stall(now)
            if stall:
                self.suspects = self.frozen()
                self.verdict = stall
                self.stopped = self.stop()
                return self.proc.returncode
            time.sleep(_POLL_S)
        self._read(time.monotonic())
        return code

    def _read(self, now: float) -> None:
        """Take in the heartbeats of this launcher's workers (a shared run directory may hold others')."""
        for path in self.run_dir.glob(heartbeat_file("*")):
            try:
                beat = json.loads(path.read_text())
                rank, pid = int(beat["rank"]), int(beat["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if not self._owns(pid, rank):
                continue
            key = (beat.get("phase"), beat.get("step"), beat.get("progress"))
            old = self.beats.get(rank)
            if old is None or (old.get("phase"), old.get("step"), old.get("progress")) != key:
                self.moved[rank] = now
            self.beats[rank] = beat

    def _owns(self, pid: int, rank: int) -> bool:
        """Whether `pid` is a worker of this run's torchrun, remembered by its start time against pid reuse."""
        if pid in self.started_at:
            return True
        fields = _stat(pid)
        if not fields:
            return rank in self.ranks and not Path("/proc/self").exists()  # no /proc: trust the rank range
        if int(fields[1]) != self.proc.pid:
            return False
        self.started_at[pid] = fields[19]
        return True

    def running(self, pid: int) -> bool:
        """Whether worker `pid` (seen by `_owns`) still runs: same start time, not a zombie."""
        fields = _stat(pid)
        if not fields:
            if Path("/proc/self").exists():
                return False
            try:  # no /proc (macOS): only liveness can be checked
                os.kill(pid, 0)
            except OSError:
                return False
            return True
        return fields[19] == self.started_at.get(pid) and fields[0] != "Z"

    def _stall(self, now: float) -> str:
        if not self.beats:
            waited = now - self.started
            if waited > max(self.timeout, START_S) + WATCHDOG_SLACK_S:
                where = f"at {self.endpoint}" if self.endpoint.given else f"on {self.endpoint.listen_host}"
                return (
                    f"the rendezvous {where} did not complete within {waited:.0f} s: no rank started (are all "
                    "nodes running with the same --rdzv-endpoint, and can they reach it?)"
                )
            return ""
        stalled = []
        for rank, beat in self.beats.items():
            phase = beat.get("phase")
            if phase in ("done", "failed"):
                continue
            bound = self.timeout + WATCHDOG_SLACK_S + (PREPARE_S if phase == "preparing" else 0.0)
            if now - self.moved[rank] > bound:
                stalled.append((self.moved[rank], rank, now - self.moved[rank]))
        if not stalled:
            return ""
        _, rank, idle = min(stalled)
        return f"rank {rank} {self._describe(rank)} made no progress for {idle:.0f} s (watchdog)"

    def _describe(self, rank: int) -> str:
        beat = self.beats[rank]
        state = _process_state(int(beat["pid"]))
        where = f"(pid {beat['pid']}, {beat.get('phase')}" + (
            f", step {beat['step']})" if beat.get("step") is not None else ")"
        )
        if state == "T":
            return f"{where} was stopped (SIGSTOP or a debugger) and"
        if time.time() - float(beat["time"]) > self.timeout:
            return f"{where} stopped beating (frozen) and"
        return where

    def frozen(self) -> dict[int, str]:
        """Ranks still unfinished whose process is stopped or whose heartbeat went stale: a likely cause."""
        found = {}
        for rank, beat in self.beats.items():
            if beat.get("phase") in ("done", "failed"):
                continue
            pid = int(beat["pid"])
            stale = time.time() - float(beat["time"]) > max(2.0, 4 * heartbeat_interval(self.timeout))
            state = _process_state(pid)
            if state == "T" or (stale and state not in ("", "Z")):
                step = f" at step {beat['step']}" if beat.get("step") is not None else ""
                how = "was stopped (SIGSTOP or a debugger)" if state == "T" else "stopped beating (frozen)"
                found[rank] = f"rank {rank} (pid {pid}) {how}{step}"
        return found

    def stop(self) -> str:
        """Stop torchrun and the workers (SIGTERM, then SIGKILL after `STOP_GRACE_S`); says what it stopped."""
        start = time.monotonic()
        workers = {r: int(b["pid"]) for r, b in self.beats.items() if self.running(int(b["pid"]))}
        parts = [f"torchrun (pid {self.proc.pid})"] if self.proc.poll() is None else []
        for rank, pid in sorted(workers.items()):
            step = self.beats[rank].get("step")
            parts.append(f"rank {rank} (pid {pid}" + (f", step {step})" if step is not None else ", preparing)"))
        for pid in workers.values():
            _send(pid, signal.SIGTERM)
            _send(pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once it runs again
        if self.proc.poll() is None:
            _send(self.proc.pid, signal.SIGTERM)
        deadline = start + STOP_GRACE_S
        while time.monotonic() < deadline and (self.proc.poll() is None or any(map(self.running, workers.values()))):
            time.sleep(_POLL_S)
        killed = [pid for pid in workers.values() if self.running(pid)]
        for pid in killed:
            _send(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            killed.append(self.proc.pid)
            self.proc.kill()
        self.proc.wait()
        if not parts:
            return "nothing was left running"
        forced = f", SIGKILL for pid(s) {', '.join(map(str, killed))}" if killed else ""
        return f"{'; '.join(parts)}; all ended within {time.monotonic() - start:.1f} s{forced}"


def _send(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...); [] if gone or no /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return []


def _process_state(pid: int) -> str:
    """The state letter of `pid` (R, S, T, Z...), '' if it is gone or /proc is absent."""
    fields = _stat(pid)
    return fields[0] if fields else ""


def _rendezvous_error(log: str, endpoint: Endpoint) -> str:
    """Why no worker started, from torchrun's log: the rendezvous did not complete, or torchrun's own error."""
    lines = [line.strip() for line in log.splitlines() if re.search(r"\w+(Error|Exception): ", line)]
    last = lines[-1] if lines else "no error in its log"
    if "Rendezvous" in log or "rendezvous" in last:
        return f"the rendezvous at {endpoint} did not complete ({last}); is node 0 running, and reachable there?"
    return last


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


def _first_failure(
    errors: dict[int, dict[str, Any]],
    silent: set[int],
    root: tuple[int, int] | None = None,
    frozen: dict[int, str] | None = None,
) -> str:
    """The cause: the rank that failed first for a reason of its own; the others' errors named as its echoes.

    In order: the earliest error that is not an echo (a lost peer, a wait that ran out); else a rank the
    watchdog saw stopped or frozen (`frozen`); else the rank torchrun saw die without a report (`root`);
    else the earliest echo, which points at the rank that stopped answering.
    """
    frozen = frozen or {}
    primary = sorted((e for e in errors.values() if not e["secondary"]), key=lambda e: e["time"])
    if primary:
        first = primary[0]
        return f"{first['message']}{_echoes(errors, silent, int(first['rank']))}"
    if frozen:
        rank = min(frozen)
        return f"{frozen[rank]}{_echoes(errors, silent - {rank}, rank)}"
    if root is not None and root[0] not in errors:
        rank, code = root
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        cause = f"rank {rank} {how} without reporting an error (killed, or out of memory?)"
        return f"{cause}{_echoes(errors, silent - {rank}, rank)}"
    if errors:
        first = sorted(errors.values(), key=lambda e: e["time"])[0]
        return f"{first['message']}{_echoes(errors, silent, int(first['rank']))}"
    if silent:
        ranks = ", ".join(str(r) for r in sorted(silent))
        return f"rank(s) {ranks} exited without reporting an error (killed by a signal or out of memory?)"
    return "torchrun failed before any rank reported"


def _echoes(errors: dict[int, dict[str, Any]], silent: set[int], cause: int) -> str:
    """What the other ranks did after rank `cause` failed: lost their peer, timed out, or ended silently."""
    lines = []
    for rank, error in sorted(errors.items()):
        if rank == cause:
            continue
        message = str(error["message"])
        if not error["secondary"]:
            what = f"failed too, later: {message.removeprefix(f'rank {rank}').lstrip(',: ')}"
        elif "timed out" in message.lower():
            what = f"timed out waiting after rank {cause} failed"
        else:
            what = f"lost its peer after rank {cause} failed"
        lines.append(f"rank {rank}: {what}")
    if silent - {cause}:
        lines.append(f"rank(s) {', '.join(map(str, sorted(silent - {cause})))}: stopped without a report")
    return f". Echoes, not causes: {'; '.join(lines)}" if lines else ""


# ------------------------------------------------------------------------------- aggregation


def _aggregate(plan: Plan, reports: dict[int, dict[str, Any]], states: dict[int, dict[str, Any]]) -> RunResult:
    per_step: dict[int, dict[int, float]] = {}
    for report in reports.values():
        for step, mbs in report["losses"].items():
            # Each replica of a split loss stage reports its share of a microbatch's loss: they add up.
            found = per_step.setdefault(int(step), {})
            for m, v in mbs.items():
                found[int(m)] = found.get(int(m), 0.0) + v
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
        cpu_waits=[_cpu_wait(reports[r], [windows[k] for k in timed]) for r in sorted(reports)],
        cores=[reports[r].get("cores") for r in sorted(reports)],
        step_s=_periods(windows),
    )


def _cpu_wait(report: dict[str, Any], windows: list[tuple[float, float]]) -> float | None:
    """The share of `windows` (the timed steps) the rank spent waiting for a CPU within its instructions."""
    inside = [s for s in report["spans"] if any(a <= s["start_s"] and s["end_s"] <= b for a, b in windows)]
    seconds = sum(b - a for a, b in windows)
    if not inside or seconds <= 0 or any(s.get("queued_s") is None for s in inside):
        return None
    return sum(s["queued_s"] for s in inside) / seconds


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


def _periods(windows: dict[int, tuple[float, float]]) -> list[float]:
    """`RunResult.step_s` from the steps' windows (earliest start, latest end over the ranks)."""
    steps = sorted(windows)
    return [windows[k][1] - (windows[steps[i - 1]][1] if i else windows[k][0]) for i, k in enumerate(steps)]


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
