"""Faults injected into real torchrun runs: every process ends, the cause is named, every wait is bounded.

Each case starts `dapple run` (or `run`) on a small CPU plan, injects one fault (a signal to the launcher
or to a worker, a raising rank, a rendezvous that cannot complete) and checks what the run printed,
how fast it ended, and that no process of it is left (by pid, from /proc). docs/faults.md has the table.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dapple_ir.backends.torch.launch import STOP_GRACE_S, WATCHDOG_SLACK_S, Interrupted, free_port, run
from dapple_ir.errors import DappleError, RuntimeFailure
from tests.test_runtime import MLP, make_plan
from tests.test_runtime_failures import EXPLODING

pytestmark = pytest.mark.slow

#: Seconds a CPU worker may take to start (torch import, capture of the model, process group) on a busy machine.
START_S = 90.0
#: Steps no test waits for: the run is still training when the fault is injected.
ENDLESS = 1_000_000


@pytest.fixture
def plan(tmp_path: Path) -> Path:
    return make_plan(tmp_path / "plan", MLP, stages=2, kind="1f1b")


def _launch(
    plan: Path, tmp_path: Path, timeout: float = 30.0, flags: tuple[str, ...] = (), name: str = "launcher"
) -> subprocess.Popen[bytes]:
    """`dapple run PLAN` as a process of its own, training for longer than any test waits."""
    command = [sys.executable, "-m", "dapple_ir.cli", "run", str(plan), "--steps", str(ENDLESS)]
    command += ["--timeout", str(timeout), "--device", "cpu", *flags]
    out = (tmp_path / f"{name}.out").open("wb")
    # An interface named in the environment would be the user's choice, which the launcher keeps.
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)


def _beats(run_dir: Path) -> dict[int, dict[str, object]]:
    found = {}
    for path in run_dir.glob("heartbeat_rank_*.json"):
        try:
            beat = json.loads(path.read_text())
        except ValueError:
            continue  # written atomically, but a rank may be replacing it right now
        found[int(beat["rank"])] = beat
    return found


def _training(launcher: subprocess.Popen[bytes], run_dir: Path, ranks: int) -> dict[int, int]:
    """Wait until every rank has finished a step; their pids by rank."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        assert launcher.poll() is None, "the launcher ended before the ranks trained"
        beats = _beats(run_dir)
        if len(beats) == ranks and all(b["phase"] == "training" and int(str(b["step"])) >= 1 for b in beats.values()):
            return {r: int(str(b["pid"])) for r, b in beats.items()}
        time.sleep(0.1)
    raise AssertionError(f"the ranks did not start training within {START_S:g} s")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError):
                continue
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie no longer runs; whoever adopted it reaps it


def _all_gone(pids: set[int], within: float) -> set[int]:
    """The pids still running after `within` seconds (empty when all ended)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(map(_alive, pids)):
        time.sleep(0.05)
    return {p for p in pids if _alive(p)}


def _finish(launcher: subprocess.Popen[bytes], within: float) -> float:
    """Seconds until the launcher exits (fails the test after `within`)."""
    start = time.monotonic()
    try:
        launcher.wait(within)
    except subprocess.TimeoutExpired:
        launcher.kill()
        raise AssertionError(f"the launcher did not end within {within:g} s") from None
    return time.monotonic() - start


def _listening(pid: int) -> list[str]:
    """The addresses of the TCP sockets `pid` holds in LISTEN state, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(_address(fields[1]))
    return found


def _address(hex_address: str) -> str:
    """`0100007F:1F90` (little-endian words, as /proc/net/tcp{,6} write them) as `127.0.0.1:8080`."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return f"{ipaddress.ip_address(words)}:{int(port, 16)}"


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.rpartition(":")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


def test_address_decoding() -> None:
    assert _address("0100007F:1F90") == "127.0.0.1:8080"
    assert _address("00000000000000000000000001000000:0050") == "::1:80"
    assert _address("00000000000000000000000000000000:0050") == ":::80"
    assert _is_loopback("::1:80") and _is_loopback("127.0.0.1:1") and not _is_loopback(":::80")


def test_every_listening_socket_of_a_run_is_on_loopback(plan: Path, tmp_path: Path) -> None:
    launcher = _launch(plan, tmp_path)
    try:
        _training(launcher, plan / "run", 2)
        processes = _descendants(launcher.pid) | {launcher.pid}
        listening = {pid: _listening(pid) for pid in processes if _alive(pid)}
    finally:
        launcher.send_signal(signal.SIGTERM)
        _finish(launcher, 30)
    everything = [a for addresses in listening.values() for a in addresses]
    assert everything, "found no listening socket: the rendezvous store must be one"
    exposed = {pid: a for pid, addresses in listening.items() for a in addresses if not _is_loopback(a)}
    assert not exposed, f"sockets listening beyond loopback: {exposed}"


def test_two_nodes_listen_where_told_and_nowhere_else(plan: Path, tmp_path: Path) -> None:
    # c10d rendezvous: node 0 hosts the store at the endpoint, whichever agent becomes rank 0 a second one.
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        _launch(
            plan, tmp_path, flags=("--nnodes=2", f"--node-rank={n}", f"--rdzv-endpoint={endpoint}"), name=f"node{n}"
        )
        for n in (0, 1)
    ]
    try:
        _training(nodes[0], plan / "run", 2)
        processes = set().union(*(_descendants(n.pid) | {n.pid} for n in nodes))
        listening = {pid: _listening(pid) for pid in processes if _alive(pid)}
    finally:
        for node in nodes:
            node.send_signal(signal.SIGTERM)
        for node in nodes:
            _finish(node, 30)
    addresses = [a for found in listening.values() for a in found]
    assert endpoint in addresses  # node 0's store, on the socket the launcher bound
    assert all(map(_is_loopback, addresses)), listening
    assert [n.returncode for n in nodes] == [143, 143]


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_the_launcher_stops_every_process(plan: Path, tmp_path: Path, signum: int, status: int) -> None:
    launcher = _launch(plan, tmp_path)
    pids = _training(launcher, plan / "run", 2)
    processes = _descendants(launcher.pid)
    assert set(pids.values()) <= processes  # the workers are the launcher's (torchrun's children)
    launcher.send_signal(signum)
    took = _finish(launcher, 2 * STOP_GRACE_S + 10)
    assert launcher.returncode == status
    output = (tmp_path / "launcher.out").read_text()
    name = signal.Signals(signum).name
    assert f"stopped by {name}: torchrun (pid " in output
    for rank, pid in pids.items():
        assert f"rank {rank} (pid {pid}, step " in output
    assert "Traceback" not in output
    assert not _all_gone(processes, 5), "processes of the run outlived it"
    print(f"{name}: the launcher ended {took:.1f} s after the signal")


def test_launcher_killed_with_sigkill_takes_its_processes_along(plan: Path, tmp_path: Path) -> None:
    launcher = _launch(plan, tmp_path)
    pids = _training(launcher, plan / "run", 2)
    processes = _descendants(launcher.pid)
    launcher.kill()  # no handler runs: torchrun and the workers must notice on their own
    launcher.wait()
    start = time.monotonic()
    left = _all_gone(processes, 3 * STOP_GRACE_S)
    assert not left, f"processes outlived their SIGKILLed launcher: {left} (workers {pids})"
    print(f"SIGKILL of the launcher: its {len(processes)} processes were gone {time.monotonic() - start:.1f} s later")


def test_worker_killed_with_sigkill_ends_the_run(plan: Path, tmp_path: Path) -> None:
    launcher = _launch(plan, tmp_path)
    pids = _training(launcher, plan / "run", 2)
    processes = _descendants(launcher.pid)
    os.kill(pids[1], signal.SIGKILL)
    took = _finish(launcher, 30)
    output = (tmp_path / "launcher.out").read_text()
    assert launcher.returncode == 2
    assert "error: rank 1 was killed by signal 9 without reporting an error" in output
    assert "Traceback" not in output
    assert not _all_gone(processes, 5)
    print(f"kill -9 of rank 1: the run ended {took:.1f} s later")


def test_stopped_worker_is_found_by_the_watchdog(plan: Path, tmp_path: Path) -> None:
    timeout = 3.0
    launcher = _launch(plan, tmp_path, timeout=timeout)
    pids = _training(launcher, plan / "run", 2)
    processes = _descendants(launcher.pid)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        # rank 0's wait on rank 1 runs out after `timeout`; rank 1 never ends on its own, the launcher ends it.
        bound = timeout + WATCHDOG_SLACK_S + 2 * STOP_GRACE_S + 5
        took = _finish(launcher, bound)
    finally:
        os.kill(pids[1], signal.SIGCONT) if _alive(pids[1]) else None
    output = (tmp_path / "launcher.out").read_text()
    assert launcher.returncode == 2
    assert f"error: rank 1 (pid {pids[1]}) was stopped (SIGSTOP or a debugger)" in output
    assert "rank 0: timed out waiting after rank 1 failed" in output
    assert not _all_gone(processes, 5)
    print(f"SIGSTOP of rank 1 (timeout {timeout:g} s): the run ended {took:.1f} s later")


def test_rank_with_a_nan_loss_is_named_as_the_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "exploding.py"
    spec.write_text(EXPLODING)
    plan = make_plan(tmp_path / "plan", f"{spec}:factory", stages=4, kind="1f1b")
    monkeypatch.setenv("DAPPLE_TEST_NAN_STEP", "1")
    start = time.monotonic()
    with pytest.raises(RuntimeFailure) as info:
        run(plan, steps=3, transport="torchrun", timeout=30, device="cpu")
    took = time.monotonic() - start
    message = str(info.value)
    # The last stage computes the loss: rank 3 fails, its peers lose their connection to it.
    assert message.startswith("rank 3, step 1, forward @s3 mb = 0: the loss of microbatch 0 at step 1 is nan")
    assert "Echoes, not causes: rank 0: " in message
    assert "rank 2: lost its peer after rank 3 failed" in message
    errors = {r: json.loads((plan / "run" / f"error_rank_{r}.json").read_text()) for r in range(4)}
    cause_time = errors[3]["time"]
    assert all(e["secondary"] and e["time"] >= cause_time for r, e in errors.items() if r != 3), errors
    with capsys.disabled():
        print(f"\nNaN on rank 3 of 4: the run ended after {took:.1f} s with: {message[:160]}")


def _this_machine() -> str:
    """An address of this machine beyond loopback when it has one (the issue's case), else loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: picks the outgoing interface, sends nothing
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def test_busy_rendezvous_port_is_refused_before_anything_starts(plan: Path) -> None:
    host = _this_machine()
    with socket.socket() as busy:
        busy.bind((host, 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(DappleError, match=rf"port {port} of the rendezvous endpoint .* is already in use"):
            run(plan, steps=1, transport="torchrun", rdzv_endpoint=f"{host}:{port}", timeout=30, device="cpu")
    took = time.monotonic() - start
    assert took < 5
    print(f"busy rendezvous port on {host}: refused after {took:.2f} s")


def test_rendezvous_that_never_completes_is_named(plan: Path) -> None:
    # Node 1 of 2, and no node 0: nobody hosts the store at the endpoint.
    endpoint = f"127.0.0.1:{free_port()}"
    timeout = 3.0
    start = time.monotonic()
    with pytest.raises(RuntimeFailure, match=rf"the rendezvous at {endpoint} did not complete"):
        run(plan, steps=1, transport="torchrun", nnodes=2, node_rank=1, rdzv_endpoint=endpoint, timeout=timeout)
    took = time.monotonic() - start
    assert took < timeout + WATCHDOG_SLACK_S + 30  # torchrun's start included; no 182 s wait
    print(f"rendezvous without node 0 (timeout {timeout:g} s): named after {took:.1f} s")


def test_signal_during_a_threads_run_stops_its_ranks(plan: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        with pytest.raises(Interrupted, match=r"^stopped by SIGTERM") as info:
            run(plan, steps=ENDLESS, transport="threads", timeout=30)
    finally:
        timer.cancel()
    assert info.value.status == 143
    assert signal.getsignal(signal.SIGTERM) == before  # the run's handler is gone again
    deadline = time.monotonic() + 10
    while any(t.name.startswith("dapple-rank-") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("dapple-rank-")]
