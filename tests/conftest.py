"""How `pytest -n 2 --dist loadgroup` (pyproject's addopts) shares the suite out over its workers.

Tests that share an expensive thing built once per process (a module-scoped fixture, a module's capture
cache, `tests.planner_cases`) go to one worker as a group, so that no other worker builds it again;
every other test goes to whichever worker is free, the longest first, so that no worker is left running
one of them alone at the end. The groups are named here, by test id, rather than by `xdist_group`
marks: pytest-xdist 3.8 reads those by renaming the test, which pytest 9.2 no longer lets it do.
Without xdist (`-n 0`, `-p no:xdist`) nothing here applies.
"""

from __future__ import annotations

import re
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
