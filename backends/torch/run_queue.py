"""How long a rank's thread waited for a CPU: the run-queue delay Linux keeps per thread.

A rank blocked on a receive wakes when its data lands, but it runs only once a core is free. Where
ranks share cores (more ranks than cores on a CPU host, or a GPU rank's launching thread beside busy
data loaders), that delay lengthens spans without any dependency of the plan behind it. Linux
counts it per thread in `/proc/self/task/<tid>/schedstat` (the second field, nanoseconds spent
runnable but not running). The runtime reads it around every instruction (`Span.queued_s`), so a
measured timeline can tell waiting for a peer from waiting for a core.
"""

from __future__ import annotations

import os
import threading
import weakref


class RunQueueClock:
    """Seconds the calling thread has spent runnable but not running; `read` gives None where the system does
    not say (not Linux, or a kernel without scheduler statistics). One descriptor per thread, read in place with
    one `pread` (about 3 us)."""

    def __init__(self) -> None:
        self._fds: dict[int, int | None] = {}
        # The descriptors close with the clock (a runtime per run: many in one test process).
        self.close = weakref.finalize(self, _close_all, self._fds)

    def read(self) -> float | None:
        tid = threading.get_native_id()
        if tid not in self._fds:
            try:
                self._fds[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                self._fds[tid] = None
        fd = self._fds[tid]
        if fd is None:
            return None
        try:
            return int(os.pread(fd, 128, 0).split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return None


def _close_all(fds: dict[int, int | None]) -> None:
    for fd in fds.values():
        if fd is not None:
            os.close(fd)
    fds.clear()
