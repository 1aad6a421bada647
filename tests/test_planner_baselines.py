"""Baselines against brute force and hand-reasoned cases."""

from __future__ import annotations

import itertools
import random

import pytest

from dapple_ir.cluster.spec import parse_shorthand
from dapple_ir.planner.baselines import (
    data_parallel,
    pipedream_stages,
    time_balanced_partition,
    uniform_partition,
)
from dapple_ir.planner.cost_model import Problem, microbatch_choices


def _problem(fwd: list[float], grads: list[float], cuts: list[float], cluster: str = "1x2xV100-16GB") -> Problem:
    n = len(fwd)
    return Problem(fwd, [2 * f for f in fwd], [1e6] * n, [1e6] * n, grads, cuts, parse_shorthand(cluster), 64, 64, 64)


@pytest.mark.parametrize("seed", range(30))
def test_time_balanced_partition_minimises_the_heaviest_stage(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    fwd = [rng.uniform(0.0, 1.0) for _ in range(n)]
    stages = rng.randint(1, n)
    problem = _problem(fwd, [0.0] * n, [0.0] * n)
    bounds = time_balanced_partition(problem, stages)
    assert bounds is not None and bounds[0] == 0 and bounds[-1] == n
    assert all(a < b for a, b in itertools.pairwise(bounds))

    def heaviest(b: list[int]) -> float:
        return max(sum(3 * f for f in fwd[b[i] : b[i + 1]]) for i in range(stages))

    brute = min(heaviest([0, *c, n]) for c in itertools.combinations(range(1, n), stages - 1))
    assert heaviest(bounds) == pytest.approx(brute)


def test_uniform_partition_counts() -> None:
    problem = _problem([1.0] * 10, [0.0] * 10, [0.0] * 10)
    bounds = uniform_partition(problem, 4)
    assert bounds is not None
    assert sorted(b - a for a, b in itertools.pairwise(bounds)) == [2, 2, 3, 3]
    assert uniform_partition(problem, 11) is None


def test_pipedream_replicates_when_sync_is_free_and_pipelines_when_it_is_not() -> None:
    # No gradients, heavy activations: one stage replicated on both devices.
    free_sync = _problem([0.1, 0.1], [0.0, 0.0], [1e10, 0.0])
    assert pipedream_stages(free_sync) == ([0, 2], [2])
    # Huge gradients, tiny activations: two stages of one device each.
    costly_sync = _problem([0.1, 0.1], [1e12, 1e12], [1.0, 0.0])
    assert pipedream_stages(costly_sync) == ([0, 1, 2], [1, 1])


def test_data_parallel_uses_every_device() -> None:
    problem = _problem([0.1] * 4, [1e6] * 4, [1e6] * 4, cluster="2x4xV100-16GB")
    found = data_parallel(problem)
    assert found is not None
    cand, est = found
    assert len(cand.stages) == 1 and cand.stages[0].devices == tuple(range(8))
    assert est.fits


@pytest.mark.parametrize(
    ("global_batch", "devices", "largest"),
    [
        (512, 64, 512),  # at most 8 per device and 1,024: 512 itself
        (1024, 8, 64),  # 8 per device
        (64, 1, 16),  # at least 16
        (3072, 384, 3072),  # past 1,024: up to 16 per device, one sample each (Megatron's 1T)
        (2160, 480, 2160),  # 310.1B at T=4: Megatron's 2,160 microbatches
        (2160, 120, 1080),  # 16 per device is 1,920: the largest divisor of 2,160 below it
    ],
)
def test_microbatch_choices_end_at_the_largest_divisor_under_the_cap(
    global_batch: int, devices: int, largest: int
) -> None:
    found = microbatch_choices(global_batch, devices)
    assert found[-1] == largest
    assert all(global_batch % m == 0 for m in found) and found == sorted(found)
