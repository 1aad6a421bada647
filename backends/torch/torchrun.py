"""The torchrun transport: one worker process per rank, started by `torch.distributed.run`.

`run_torchrun` starts torchrun for this node's ranks (`torchrun_command`; the process it runs is
`torchrun_main`, tied to the launcher and listening only where told), lets the watchdog follow it to
the end, and reads back what the ranks reported; a failure is raised with its cause named
(`failure_report`).
"""

from __future__ import annotations

import math
import os
import runpy
import signal
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from dapple_ir.backends.torch.failure_report import torchrun_failure
from dapple_ir.backends.torch.rendezvous import Endpoint, is_loopback, listen, loopback_interface
from dapple_ir.backends.torch.results import read_reports
from dapple_ir.backends.torch.stop_signals import Interrupted, Signalled, hold_signals
from dapple_ir.backends.torch.watchdog import Watch
from dapple_ir.backends.torch.worker import PARENT_PID_ENV, RunOptions, die_with_parent, worker_flags
from dapple_ir.errors import DappleError, RuntimeFailure
from dapple_ir.plan_dir import Plan

#: What torchrun and its workers print, in the run directory.
_LOG = "torchrun.log"


def run_torchrun(
    plan: Plan, options: RunOptions, nnodes: int, node_rank: int, endpoint: Endpoint
) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """Train this node's ranks under torchrun: (their reports, their final states) by rank."""
    run_dir = Path(options.run_dir)
    per_node = plan.ranks // nnodes
    local = range(node_rank * per_node, (node_rank + 1) * per_node)
    proc, endpoint = _start(plan, options, nnodes, node_rank, endpoint)
    watch = Watch(proc, run_dir, local, options.timeout, endpoint)
    code = _wait(watch)
    # c10d rendezvous numbers the nodes as they join, not by --node-rank: on several nodes the ranks are
    # those of this torchrun's workers, as their heartbeats say (the node_rank range if none was seen).
    ours = sorted(watch.beats) if nnodes > 1 and watch.beats else list(local)
    errors = read_reports(run_dir, "error_rank_{}.json", ours)
    reports = read_reports(run_dir, "rank_{}.json", ours)
    silent = set(ours) - set(reports) - set(errors)
    if errors or code != 0 or silent or watch.verdict:
        raise RuntimeFailure(torchrun_failure(watch, errors, reports, silent, run_dir / _LOG))
    states = {r: torch.load(run_dir / f"rank_{r}_params.pt", weights_only=True) for r in ours}
    return reports, states


def _start(
    plan: Plan, options: RunOptions, nnodes: int, node_rank: int, endpoint: Endpoint
) -> tuple[subprocess.Popen[bytes], Endpoint]:
    """Start torchrun (node 0 on the store socket it binds first); the endpoint with the port it got."""
    sock = listen(endpoint) if node_rank == 0 else None
    if sock is not None:
        endpoint = replace(endpoint, port=int(sock.getsockname()[1]))
    try:
        command = torchrun_command(plan, options, nnodes, node_rank, endpoint)
        env = _torchrun_env(endpoint, sock)
        with (Path(options.run_dir) / _LOG).open("w") as log:
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
    return proc, endpoint


def _wait(watch: Watch) -> int:
    """torchrun's exit status; on a signal, or anything else that goes wrong here, it and the ranks stop first."""
    try:
        return watch.wait()
    except Signalled as sig:
        hold_signals()  # a second Ctrl-C must not cut the stop short; it is bounded anyway
        name = signal.Signals(sig.signum).name
        print(f"dapple run: {name} received, stopping torchrun and the ranks", file=sys.stderr, flush=True)
        stopped = watch.stop()
        raise Interrupted(sig.signum, f"stopped by {name}: {stopped}") from None
    except BaseException:
        watch.stop()  # whatever went wrong here, no process of the run outlives it
        raise


def check_torchrun_can_start() -> None:
    """Refuse a torchrun run where this torch build cannot start one."""
    if not torch.distributed.is_available():
        raise DappleError(
            f"this torch build ({torch.__version__}) has no torch.distributed, so torchrun cannot start "
            "the ranks; install a torch build with distributed support, or run all ranks in one process "
            "with --transport threads"
        )


def torchrun_command(plan: Plan, options: RunOptions, nnodes: int, node_rank: int, endpoint: Endpoint) -> list[str]:
    """The torchrun command line that `run` starts (one worker process per local rank).

    It runs `torchrun_main` (torchrun tied to this process, its store on the socket `listen` bound).
    """
    command = [
        sys.executable,
        "-c",
        "from dapple_ir.backends.torch.torchrun import torchrun_main; torchrun_main()",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={plan.ranks // nnodes}",
        f"--node-rank={node_rank}",
        "--max-restarts=0",
        "--monitor-interval=0.1",
        f"--local-addr={endpoint.listen_host}",
    ]
    if endpoint.given:
        # Bounded joins; node 0 hosts the store (on the socket bound by `listen`), the others dial it.
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
    loopback = loopback_interface()
    if is_loopback(endpoint.listen_host) and loopback:
        # gloo's and NCCL's own sockets (one pair per peer) on loopback too; a user's choice stands.
        env.setdefault("GLOO_SOCKET_IFNAME", loopback)
        env.setdefault("NCCL_SOCKET_IFNAME", loopback)
    return env
