"""Working on the IR of a thousand ranks: millions of rank-program instructions made or walked at once."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a block that makes or walks millions of lasting objects (the rank
    programs' instructions of a thousand ranks, a simulation of them): each full collection walks every object
    alive, and such a block sets off several, which took more time than the block's own work. Reference counting
    still frees all that is not in a cycle; the collector runs again after the block."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
