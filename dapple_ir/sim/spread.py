"""The simulator under costs that vary from step to step: each instruction's time drawn from its samples.

On a shared host (rank processes time-sharing cores, a noisy neighbour) a computation's time varies from one
step to the next, and a rank that depends on another waits for whichever of its producers ran slow. A
simulation at median costs predicts the undisturbed step, and so less waiting than the ranks see.
`simulate_spread` draws every sampled instruction's time independently from its own samples (a measured
trace's spans: `bench/runtime_vs_torch_pipelining.py`), simulates each draw (`simulate_each`),
and reports waiting the way a measurement does: per rank, one minus its median busy time over the median
iteration.

    from dapple_ir.sim.spread import simulate_spread
    spread = simulate_spread(module, samples={(0, 3): [0.011, 0.012, 0.031], ...}, draws=31)
    spread.bubble_fraction        # per rank
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import median

from dapple_ir.cluster.spec import ClusterSpec
from dapple_ir.errors import DappleError
from dapple_ir.ir import Module
from dapple_ir.sim.simulator import BACKWARD_INPUT_FRACTION, simulate_each


@dataclass(frozen=True)
class SpreadResult:
    """Every draw's iteration and per-rank busy time, and the medians a measurement would report."""

    iterations: list[float]
    busy: list[list[float]]
    """Per draw, per rank: seconds the rank computed."""

    @property
    def iteration_s(self) -> float:
        """The median iteration over the draws."""
        return median(self.iterations)

    @property
    def bubble_fraction(self) -> list[float]:
        """Per rank: 1 - its median busy time / the median iteration (a measurement's median period)."""
        period = self.iteration_s
        if period <= 0:
            return [0.0] * len(self.busy[0])
        return [1.0 - median(draw[r] for draw in self.busy) / period for r in range(len(self.busy[0]))]


def simulate_spread(
    module: Module,
    *,
    samples: Mapping[tuple[int, int], Sequence[float]],
    cluster: ClusterSpec | str | None = None,
    draws: int = 31,
    seed: int = 0,
    backward_input_fraction: float | Mapping[str, float] = BACKWARD_INPUT_FRACTION,
    steady: bool = False,
) -> SpreadResult:
    """Simulate `draws` iterations, each (rank, instruction index) in `samples` taking one of its samples,
    drawn uniformly and independently (seeded: the same call gives the same result); other instructions keep
    their modelled time. `cluster` as for `simulate`. `steady`: the draws are a run's steps back to back, each
    starting where each rank ended the draw before (`simulate_each(steady=True)`), each iteration the period."""
    if draws < 1:
        raise DappleError(f"simulate_spread: draws must be at least 1, got {draws}")
    empty = sorted(key for key, values in samples.items() if not values)
    if empty:
        rank, index = empty[0]
        raise DappleError(f"simulate_spread: rank {rank}, instruction {index} has no samples to draw from")
    rng = random.Random(seed)
    keys = sorted(samples)
    drawn = ({key: rng.choice(samples[key]) for key in keys} for _ in range(draws))
    iterations: list[float] = []
    busy: list[list[float]] = []
    for result in simulate_each(
        module, drawn, cluster=cluster, backward_input_fraction=backward_input_fraction, steady=steady
    ):
        iterations.append(result.iteration_s)
        busy.append(list(result.busy_s))
    return SpreadResult(iterations, busy)
