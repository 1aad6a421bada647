"""The planner's shortcuts give what the plain computation gives: PipeDream's recursion with its
skipped candidates, simulations shared between candidates that lower alike, and the ILP's bound."""

from __future__ import annotations

import random

import pytest

from dapple_ir.cluster.spec import parse_shorthand
from dapple_ir.planner.baselines import pipedream_stages
from dapple_ir.planner.cost_model import Candidate, Problem, StageChoice
from dapple_ir.planner.search import _lowers_alike


def _random_problem(rng: random.Random, cluster: str) -> Problem:
    n = rng.randint(1, 12)
    fwd = [rng.uniform(0.0, 1.0) for _ in range(n)]
    grads = [rng.choice([0.0, rng.uniform(0, 1e10)]) for _ in range(n)]
    cuts = [rng.choice([0.0, rng.uniform(0, 1e9)]) for _ in range(n)]
    return Problem(fwd, [2 * f for f in fwd], [1e6] * n, [1e6] * n, grads, cuts, parse_shorthand(cluster), 64, 64, 64)


def _pipedream_reference(problem: Problem) -> tuple[list[int], list[int]]:
    """The recursion of `pipedream_stages` written plainly: every candidate, in the paper's order."""
    cluster = problem.cluster
    n, layers, per_node = cluster.num_devices, problem.layers, cluster.devices_per_node
    step = 1
    while n // step > 16:
        step *= 2
    workers = list(range(step, n + 1, step))

    def stage_time(i: int, j: int, m: int) -> float:
        compute = problem.pf[j] - problem.pf[i] + problem.pb[j] - problem.pb[i]
        bandwidth = (cluster.intra if m <= per_node else cluster.inter).bandwidth
        return max(compute, 4 * (m - 1) * (problem.pg[j] - problem.pg[i]) / (m * bandwidth)) / m

    cut_bw = cluster.intra.bandwidth if n <= per_node else cluster.inter.bandwidth
    best: dict[tuple[int, int], tuple[float, int, int]] = {}
    for j in range(1, layers + 1):
        for m in workers:
            value, arg = stage_time(0, j, m), (0, m)
            for i in range(1, j):
                cut = 2 * problem.cut_bytes[i - 1] * problem.cost_batch / problem.batch / cut_bw
                for m2 in (w for w in workers if w < m):
                    candidate = max(best[(i, m - m2)][0], cut, stage_time(i, j, m2))
                    if candidate < value:
                        value, arg = candidate, (i, m2)
            best[(j, m)] = (value, *arg)
    bounds, replicas = [layers], []
    j, m = layers, workers[-1]
    while j > 0:
        _, i, m2 = best[(j, m)]
        bounds.append(i)
        replicas.append(m2)
        j, m = i, m - m2
    return bounds[::-1], replicas[::-1]


@pytest.mark.parametrize("seed", range(40))
def test_pipedream_stages_matches_the_plain_recursion(seed: int) -> None:
    rng = random.Random(seed)
    cluster = rng.choice(["1x4xV100-16GB", "2x8xV100-16GB", "16x1xV100-16GB", "8x8xA100-80GB"])
    problem = _random_problem(rng, cluster)
    assert pipedream_stages(problem) == _pipedream_reference(problem)


def _one_stage(devices: tuple[int, ...], microbatches: int, schedule: str = "1f1b") -> Candidate:
    return Candidate((StageChoice(0, 4, devices),), microbatches, schedule)


def test_one_stage_on_the_same_devices_in_another_order_lowers_alike() -> None:
    assert _lowers_alike(_one_stage((0, 1, 2, 3), 8), _one_stage((0, 2, 1, 3), 8))
    # Unequal shares: which device runs the extra microbatch depends on the order.
    assert not _lowers_alike(_one_stage((0, 1, 2, 3), 6), _one_stage((0, 2, 1, 3), 6))
    assert not _lowers_alike(_one_stage((0, 1, 2, 3), 8), _one_stage((0, 1, 2, 4), 8))


def test_schedules_lower_alike_only_when_every_replica_runs_the_same_work() -> None:
    # One microbatch per replica: forward then backward under gpipe and 1f1b alike.
    assert _lowers_alike(_one_stage((0, 1, 2, 3), 4, "1f1b"), _one_stage((0, 1, 2, 3), 4, "gpipe"))
    # zb-h1 splits the backward; more microbatches per replica order forwards differently.
    assert not _lowers_alike(_one_stage((0, 1, 2, 3), 4, "1f1b"), _one_stage((0, 1, 2, 3), 4, "zb-h1"))
    assert not _lowers_alike(_one_stage((0, 1, 2, 3), 8, "1f1b"), _one_stage((0, 1, 2, 3), 8, "gpipe"))
    two = (StageChoice(0, 2, (0,)), StageChoice(2, 4, (1,)))
    assert not _lowers_alike(Candidate(two, 4, "1f1b"), Candidate(two, 4, "gpipe"))


def test_ilp_bound_never_exceeds_its_best_plan() -> None:
    pytest.importorskip("ortools")
    from dapple_ir.planner.ilp import solve_ilp

    problem = _random_problem(random.Random(3), "2x8xV100-16GB")
    found = solve_ilp(problem, min(2, problem.layers), 16, "1f1b", time_limit_s=5.0)
    assert found is not None
    assert found.bound_s <= found.estimate.iteration_s * (1 + 1e-6)
    if found.optimal:
        assert found.gap == 0.0 and found.note == "optimal"
    # The incumbent is a real plan: the cost model gives it the time the solver reports.
    assert found.estimate.fits and found.estimate.iteration_s > 0
