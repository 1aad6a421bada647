"""The CPU cores a CPU rank runs on: `dapple run` gives each rank of a node a block of its own.

Unpinned, Linux moves a rank's threads between cores and wakes a rank whose data arrived on whichever core it
picks, often one another rank is busy on. On 2 cores and 2 ranks of the bench MLP that cost both ranks 5-8 points
of their step in waiting no dependency explains, and the interleaved schedule 10-20 % of its speed
(BENCHMARKS.md). Pinned, each rank and the threads it starts (gloo's, torch's intra-op pool) stay on its block.

Only where every local rank can have a core: with more ranks than cores, pinning two ranks to one core leaves
them nothing the scheduler could balance, and it measured no better than leaving them free. CUDA ranks are left
alone (their host threads belong next to their GPU's NUMA node: torchrun's `--numa-binding`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def rank_cores(local_rank: int, local_world: int, usable: Sequence[int]) -> list[int] | None:
    """Local rank `local_rank`'s block of `usable` (the cores this process may run on), split into `local_world`
    contiguous blocks as even as can be; None where there are fewer cores than local ranks."""
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} is not one of {local_world} local ranks")
    cores = sorted(usable)
    if len(cores) < local_world:
        return None
    n = len(cores)
    return cores[local_rank * n // local_world : (local_rank + 1) * n // local_world]


def pin_rank(local_rank: int, local_world: int) -> list[int] | None:
    """Pin this process (every thread it has, and so every thread they start) to the rank's block of the cores
    it may use (`rank_cores`); returns the block, or None where it pinned nothing (too few cores, or a system
    without `sched_setaffinity`)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    block = rank_cores(local_rank, local_world, sorted(os.sched_getaffinity(0)))
    if block is None:
        return None
    set_cores(block)
    return block


def set_cores(cores: Sequence[int]) -> None:
    """Let every thread of this process run on `cores` only (and so every thread they start); the bench gives a
    process back its first cores with it, since its runs share one process."""
    if not hasattr(os, "sched_setaffinity"):
        return
    tasks = Path("/proc/self/task")
    for tid in [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # a thread that ended since the listing
            continue
