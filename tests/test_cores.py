"""CPU ranks on cores of their own (`cores`): the blocks by hand, the pin on every thread of a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dapple_ir.backends.torch.cores import pin_rank, rank_cores


def test_each_local_rank_gets_a_contiguous_block_of_the_usable_cores() -> None:
    assert [rank_cores(r, 2, [0, 1]) for r in range(2)] == [[0], [1]]
    assert [rank_cores(r, 2, range(8)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # 8 over 3: blocks of 2, 3, 3 (r * n // L to (r + 1) * n // L), none shared, none left out.
    assert [rank_cores(r, 3, range(8)) for r in range(3)] == [[0, 1], [2, 3, 4], [5, 6, 7]]
    # Only the cores the process may use (a taskset or a cgroup left it these), in order.
    assert [rank_cores(r, 2, {6, 2, 4, 0}) for r in range(2)] == [[0, 2], [4, 6]]
    # More ranks than cores: nothing pinned.
    assert [rank_cores(r, 4, [0, 1]) for r in range(4)] == [None] * 4
    with pytest.raises(ValueError, match="local rank 2 is not one of 2 local ranks"):
        rank_cores(2, 2, [0, 1])


#: Pins local rank 1 of 2 with a thread already running and starts one after; prints every thread's cores.
PIN_AND_LIST = """
import json, os, sys, threading
from dapple_ir.backends.torch.cores import pin_rank, set_cores
given = sorted(os.sched_getaffinity(0))
stop = threading.Event()
before = threading.Thread(target=stop.wait)
before.start()
block = pin_rank(1, 2)
after = threading.Thread(target=stop.wait)
after.start()
tids = sorted(int(t) for t in os.listdir("/proc/self/task"))
pinned = {t: sorted(os.sched_getaffinity(t)) for t in tids}
set_cores(given)
back = {t: sorted(os.sched_getaffinity(t)) for t in tids}
stop.set()
json.dump({"given": given, "block": block, "pinned": pinned, "back": back}, sys.stdout)
"""


def test_pinning_holds_every_thread_of_the_process_and_set_cores_gives_them_back() -> None:
    if not hasattr(os, "sched_setaffinity"):  # macOS: nothing to pin with, and it says so
        assert pin_rank(0, 1) is None
        return
    done = subprocess.run([sys.executable, "-c", PIN_AND_LIST], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert len(seen["pinned"]) >= 3  # the main thread, one started before the pin, one after
    expected = rank_cores(1, 2, seen["given"])
    assert seen["block"] == expected
    # Every thread on the block (or, with one core, every thread where it was).
    assert all(cores == (expected or seen["given"]) for cores in seen["pinned"].values()), seen
    assert all(cores == seen["given"] for cores in seen["back"].values()), seen
