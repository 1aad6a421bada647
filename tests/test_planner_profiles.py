"""On every published profile (examples/profiles) and the example models, for DAPPLE's 2x8 and 16x1 V100 clusters, the
plan's simulated iteration time is no worse than any baseline's that fits (same simulator)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest

from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.frontend.profile_import import import_profile
from dapple_ir.ir import Module
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.passes.plan import lower_and_simulate
from dapple_ir.planner.baselines import all_baselines
from dapple_ir.planner.cost_model import problem_from_module
from dapple_ir.planner.search import Request, search
from dapple_ir.registry import PassContext
from tests.paths import PROFILE_FILES

PROFILES = PROFILE_FILES
CLUSTERS = ["2x8xV100-16GB", "16x1xV100-16GB"]
EXAMPLES = ["examples/gpt.py:factory", "examples/cnn.py:factory", "examples/mlp.py:factory"]


def _check_beats_baselines(module: Module, cluster_name: str, global_batch: int) -> None:
    cluster = resolve_cluster(cluster_name)
    module.attrs.optimizer = "adam"
    PassManager(build_pipeline("coarsen{max-layers=20}")).run(module)
    problem = problem_from_module(module, cluster, global_batch)
    outcome = search(problem, Request(method="dp"), lambda cand: lower_and_simulate(module, problem, cand))
    ours = outcome.chosen.simulated_s
    assert ours is not None, outcome.chosen.note
    checked = 0
    for name, (cand, est) in all_baselines(problem).items():
        if not est.fits:
            continue
        theirs, _peak = lower_and_simulate(module, problem, cand)
        assert ours <= theirs * (1 + 1e-9), f"{name}: {cand.describe()} simulates to {theirs} < ours {ours}"
        checked += 1
    assert checked >= 3


@pytest.mark.slow
@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.stem)
def test_profile_plan_is_no_worse_than_any_baseline(path: Path, cluster: str) -> None:
    module = import_profile(str(path))
    _check_beats_baselines(module, cluster, global_batch=max(64, 4 * (module.attrs.batch or 1)))


@pytest.mark.slow
@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("spec", EXAMPLES)
def test_example_plan_is_no_worse_than_any_baseline(spec: str, cluster: str) -> None:
    module = copy.deepcopy(_captured(spec))
    PassManager(build_pipeline("annotate-cost")).run(module, PassContext(cluster=cluster))
    _check_beats_baselines(module, cluster, global_batch=64)


@functools.cache
def _captured(spec: str) -> Module:
    from dapple_ir.frontend.spec_loader import capture_spec

    return capture_spec(spec, device="meta")
