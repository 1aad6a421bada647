"""Which rank's failure is the cause of a failed run, and which errors are only its echoes.

When one rank fails, the others fail after it: they lose their peer, or their waits run out. The
message of a failed run names the rank that failed first for a reason of its own (`first_failure`),
and lists the others as echoes; under torchrun it also reads what torchrun logged (`torchrun_failure`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from dapple_ir.backends.torch.rendezvous import Endpoint
from dapple_ir.backends.torch.watchdog import Watch
from dapple_ir.backends.torch.worker import heartbeat_file


def torchrun_failure(
    watch: Watch,
    errors: dict[int, dict[str, Any]],
    reports: dict[int, dict[str, Any]],
    silent: set[int],
    log_path: Path,
) -> str:
    """The message of a failed torchrun run, from the ranks' error reports, the watchdog and torchrun's log."""
    output = log_path.read_text()
    primary = any(not e["secondary"] for e in errors.values())
    if watch.verdict and not primary and not watch.suspects:
        message = watch.verdict  # a stuck rank, or no rank at all: nothing else knows more
    else:
        message = first_failure(errors, silent, _root_cause(output), watch.suspects)
    if not (errors or reports or watch.verdict or any(watch.run_dir.glob(heartbeat_file("*")))):
        message = f"torchrun ended before any rank started: {_rendezvous_error(output, watch.endpoint)}"
    if watch.stopped:
        message += f"; the launcher stopped what was left: {watch.stopped}"
    return f"{message} (worker output: {log_path})"


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


def first_failure(
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
