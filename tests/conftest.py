"""How `pytest -n 2 --dist loadgroup` (pyproject's addopts) shares the suite out over its workers.

Tests that share an expensive thing built once per process (a module-scoped fixture, a module's capture
cache, `tests.planner_cases`) go to one worker as a group, so that no other worker builds it again;
every other test goes to whichever worker is free, the longest first, so that no worker is left running
one of them alone at the end. The groups are named here, by test id, rather than by `xdist_group`
marks: pytest-xdist 3.8 reads those by renaming the test, which pytest 9.2 no longer lets it do.
Tests that measure how this machine schedules their threads run alone, as in one process: the other
worker starts nothing beside them (`_turn`). Without xdist (`-n 0`, `-p no:xdist`) nothing here applies.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: Modules whose tests share a build: one group per model (the bracketed test id; a module-scoped fixture
#: or a cache per model), or one group for the module.
_PER_MODEL = ("tests/test_hf_models.py::", "tests/test_hf_capture.py::")
_PER_MODULE = ("tests/test_capture.py::",)
#: Tests that read `tests.planner_cases.vgg19_search`.
_VGG19_SEARCH = (
    "tests/test_planner_profiles.py::test_vgg19_plan_is_no_slower_than_fifteen_plus_one[",
    "tests/test_split_planner.py::test_vgg19_fifteen_plus_one_split_runs_near_its_compute_floor[",
)
#: Tests that compare the time their threads waited for a CPU with the time they took.
_ALONE = ("tests/test_runtime.py::test_timeline_and_memory_are_measured", "tests/test_run_queue.py::")
#: Tests of a minute or so on two cores, started first.
_LONGEST = (
    "tests/test_recompute.py::test_llama_2_70b_plans_on_8x8xh100_only_with_recomputation",
    "tests/test_quickstart.py::test_readme_quickstart_end_to_end",
)


def group_of(nodeid: str) -> str:
    """The unit of work `nodeid` goes to a worker in: its group, or the test alone."""
    if nodeid.startswith(_VGG19_SEARCH):
        return "vgg19_search"
    if nodeid.startswith(_PER_MODEL) and (model := re.search(r"\[([^\]]+)\]$", nodeid)):
        return f"{nodeid.split('::')[0]}[{model.group(1)}]"
    if nodeid.startswith(_PER_MODULE):
        return nodeid.split("::")[0]
    return nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return Groups(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the order it reports is the order work is sent in
        items.sort(key=lambda item: not item.nodeid.startswith(_LONGEST))  # stable: the rest keep their order


@contextlib.contextmanager
def _turn(config: pytest.Config, alone: bool) -> Iterator[None]:
    """In an xdist worker: a test runs while holding a shared lock of this run, one that runs alone the lock
    itself. It also holds a gate while it waits, through which every test passes first, so that a test
    waiting to run alone is not kept waiting by the tests that start after it."""
    basetemp = getattr(config.option, "basetemp", None)
    if not hasattr(config, "workerinput") or not basetemp:
        yield
        return
    import fcntl

    run_dir = Path(basetemp).parent  # xdist gives each worker a folder of this run's temporary folder
    with (run_dir / "tests-gate.lock").open("a") as gate, (run_dir / "tests-alone.lock").open("a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    with _turn(item.config, alone=item.nodeid.startswith(_ALONE)):
        return (yield)
