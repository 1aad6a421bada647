"""Ctrl-C and SIGTERM during a run: every process of the run stops, and `run` raises `Interrupted`.

While `run` lasts (`stoppable`), SIGINT and SIGTERM raise `Signalled` in the main thread; the
transport that is running catches it, stops what it started (torchrun and the workers, or the rank
threads' waits), and raises `Interrupted` with the exit status a shell reports for the signal.
"""

from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

from dapple_ir.errors import RuntimeFailure


class Interrupted(RuntimeFailure):
    """The run was stopped by SIGINT or SIGTERM; `status` is the exit status to end with (128 + signal)."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.status = 128 + signum


class Signalled(BaseException):
    """Raised in the main thread by SIGINT or SIGTERM while `run` lasts (see `_signals_raise`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _signals_raise() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into `Signalled` while the run lasts, so that it can stop what it started."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; a run in another thread leaves them alone
        return

    def handler(signum: int, frame: Any) -> None:
        raise Signalled(signum)

    before = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def hold_signals() -> None:
    """Ignore SIGINT and SIGTERM until `_signals_raise` restores the handlers."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def stoppable(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """`fn` with SIGINT and SIGTERM raising `Interrupted` (after `run_torchrun` stopped its processes)."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with _signals_raise():
            try:
                return fn(*args, **kwargs)
            except Signalled as sig:  # before torchrun started, or under threads (they end with this process)
                name = signal.Signals(sig.signum).name
                raise Interrupted(sig.signum, f"stopped by {name}; no rank process had started") from None

    return wrapper
