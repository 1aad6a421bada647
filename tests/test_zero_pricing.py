"""ZeRO-1 priced once (pricing/): the reduce-scatter and all-gather halves add up to the ring allreduce, a shard's
step is the step over 1/R, a sharded stage holds 1/R of its state; the planner's twins and `compile --zero all`."""

from __future__ import annotations

import dataclasses

import pytest

from dapple_ir.cluster.spec import parse_shorthand
from dapple_ir.cluster.topology import Network
from dapple_ir.planner.cost_model import Candidate, Problem, StageChoice, evaluate
from dapple_ir.pricing.collectives import ring_allreduce


def chain_problem() -> Problem:
    """Four layers of 100 MB of parameters each on 1x4xV100."""
    n = 4
    return Problem(
        [0.01] * n, [0.02] * n, [1e6] * n, [5e8] * n, [1e8] * n, [1e6] * n, parse_shorthand("1x4xV100-16GB"), 64, 64, 64
    )


def test_the_two_halves_cost_and_move_what_the_allreduce_does() -> None:
    ring = ring_allreduce(Network(parse_shorthand("2x4xV100-16GB")), [0, 1, 4, 5])
    nbytes = 3e8
    assert ring.reduce_scatter_s(nbytes) + ring.all_gather_s(nbytes) == pytest.approx(ring.seconds(nbytes))
    assert 2 * ring.shard_step_bytes(nbytes) == pytest.approx(ring.step_bytes(nbytes))
    assert ring.shard_step_bytes(nbytes) == pytest.approx(0.75 * nbytes)


def test_a_sharded_twin_holds_less_and_steps_less() -> None:
    problem = chain_problem()
    cand = Candidate((StageChoice(0, 2, (0,)), StageChoice(2, problem.layers, (1, 2))), microbatches=4)
    twin = dataclasses.replace(cand, zero=(False, True))
    plain, sharded = evaluate(problem, cand), evaluate(problem, twin)
    saved = problem.grads_of(2, problem.layers) * problem.state_factor / 2
    assert plain.stage_peak_bytes[1] - sharded.stage_peak_bytes[1] == pytest.approx(saved)
    assert plain.stage_peak_bytes[0] == sharded.stage_peak_bytes[0]
    assert sharded.iteration_s <= plain.iteration_s
    assert "zero s1" in twin.describe() and twin.replication() == "1,2z"
