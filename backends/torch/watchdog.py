"""The watchdog: a run that stops making progress ends within bounds that do not grow with the steps.

Every wait inside a rank is bounded by the run's timeout and names what it waited for; the watchdog
is the net below that, for what no rank can report itself: a compute call that never returns, a rank
stopped (SIGSTOP, a debugger) or frozen, a rendezvous that never completes, processes that linger
after a rank failed. Under torchrun it follows the ranks' heartbeats (`Watch`) and stops torchrun and
the workers itself; under threads it follows the runtimes' progress (`join_while_progressing`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from dapple_ir.backends.torch.rendezvous import Endpoint
from dapple_ir.backends.torch.runtime import Runtime
from dapple_ir.backends.torch.worker import heartbeat_file, heartbeat_interval

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


def join_while_progressing(threads: list[threading.Thread], runtimes: list[Runtime], bound: float) -> list[int]:
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


class Watch:
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
