"""How many devices a model needs at least, by the cost model's memory alone.

A candidate fits when every stage fits its devices: `stage_memory` (static bytes of its layers plus
`in_flight` microbatches of their activations) at most the device's capacity. Whatever the cuts,
replica counts and placement, a stage [lo, hi) that is the n-th stage from the end, with R replicas
each running ceil(M / R) of the M microbatches, holds `in_flight(schedule, n, ceil(M / R))` of them;
more replicas lower that count, more stages raise it for the stages in front. `fewest_devices` finds,
by dynamic programming over (first layer, stages from there to the end), the least total replica
count over every candidate of M microbatches that fits. No candidate on fewer devices can fit, so no
planner (DP, ILP, baselines) can find one there: that makes it a sound lower bound for advice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dapple_ir.planner.cost_model import Problem, in_flight


@dataclass(frozen=True)
class Tightest:
    """The layer that needs the most memory when alone on a device with one sample in flight."""

    index: int
    name: str
    static_bytes: float
    activation_bytes: float
    """Activations of one sample (the smallest microbatch)."""

    @property
    def total(self) -> float:
        return self.static_bytes + self.activation_bytes


def tightest_layer(problem: Problem) -> Tightest:
    """The layer with the largest static bytes plus one sample's activations: the least any device
    hosting it needs, since a stage's replicas can always be made many enough to hold one microbatch."""
    per_sample = [a / problem.cost_batch for a in problem.act_bytes]
    i = max(range(problem.layers), key=lambda k: problem.static_bytes[k] + per_sample[k])
    name = problem.names[i] if i < len(problem.names) else f"L{i}"
    return Tightest(i, name, problem.static_bytes[i], per_sample[i])


@dataclass(frozen=True)
class LeanPlan:
    """The cuts and replica counts of a candidate that fits on the fewest devices."""

    bounds: tuple[int, ...]
    """Cut points [0, ..., L]: stage k holds layers bounds[k]..bounds[k + 1] - 1."""
    replicas: tuple[int, ...]

    @property
    def devices(self) -> int:
        return sum(self.replicas)


def leanest_plan(
    problem: Problem,
    microbatches: int,
    schedule: str = "1f1b",
    stages: int | None = None,
    *,
    transfers: bool = False,
    recompute: bool = False,
) -> LeanPlan | None:
    """The candidate with `microbatches` microbatches (and exactly `stages` stages, when given) that
    fits in memory on the fewest devices of capacity `problem.capacity(0)`, or None when none fits
    on any number of devices.

    The memory is the cost model's (`stage_memory`); with `transfers`, also what a rank program
    holds beyond it: the values received from earlier stages, kept with each microbatch in flight,
    and the gradient received from the next stage (at most the bytes crossing the cut before and
    after the stage), plus the larger of the two posted ahead of its use (`peak_memory.post_headroom`),
    so that the plan also fits once lowered, as the simulator counts it. With
    `recompute`, each stage may also recompute (`stage_memory`): it then holds one microbatch's
    activations and, per microbatch in flight, its input; whichever needs fewer replicas."""
    fit = _StageFit(problem, microbatches, schedule, transfers=transfers, recompute=recompute)
    layers, ps, cap = problem.layers, problem.ps, fit.cap
    # rounds[n - 1][lo]: (devices, end of the first stage, its replicas) of the leanest plan of
    # layers [lo, L) as exactly n stages.
    rounds: list[list[tuple[float, int, int]]] = []
    previous = [(math.inf, 0, 0)] * layers + [(0.0, layers, 0)]
    answer, answer_n = math.inf, 0
    for n in range(1, (stages or layers) + 1):
        if n > answer:
            break  # every stage takes a device: n stages cannot beat `answer`
        current = [(math.inf, 0, 0)] * (layers + 1)
        for lo in range(layers):
            for hi in range(lo + 1, layers + 1):
                if ps[hi] - ps[lo] > cap:
                    break  # longer stages hold at least these static bytes
                rest = previous[hi][0]
                if rest == math.inf:
                    continue
                r = fit.replicas(lo, hi, n)
                if r is not None and r + rest < current[lo][0]:
                    current[lo] = (r + rest, hi, r)
        rounds.append(current)
        previous = current
        if (stages is None or n == stages) and current[0][0] < answer:
            answer, answer_n = current[0][0], n
    if answer == math.inf:
        return None
    bounds, counts, lo = [0], [], 0
    for n in range(answer_n, 0, -1):
        _devices, hi, r = rounds[n - 1][lo]
        bounds.append(hi)
        counts.append(r)
        lo = hi
    return LeanPlan(tuple(bounds), tuple(counts))


class _StageFit:
    """How many replicas a stage needs to fit in memory under `leanest_plan`'s rules."""

    def __init__(self, problem: Problem, microbatches: int, schedule: str, *, transfers: bool, recompute: bool):
        self.problem, self.microbatches, self.schedule, self.recompute = problem, microbatches, schedule, recompute
        self.cap = problem.capacity(0)
        self.b = problem.microbatch_size(microbatches)
        self.act_scale = self.b / problem.cost_batch
        self.cut_scale = self.b / problem.batch if transfers else 0.0

    def replicas(self, lo: int, hi: int, n: int) -> int | None:
        """The fewest replicas with which layers [lo, hi), n-th stage from the end, fit."""
        problem = self.problem
        ps, pa, cut = problem.ps, problem.pa, problem.cut_bytes
        received = cut[lo - 1] * self.cut_scale if lo > 0 else 0.0
        grad = cut[hi - 1] * self.cut_scale if hi < problem.layers else 0.0
        # Receives posted one compute ahead hold up to one compute's inputs more (`peak_memory.post_headroom`).
        ahead = max(received, grad)
        room = self.cap - (ps[hi] - ps[lo]) - grad - ahead
        full = (pa[hi] - pa[lo]) * self.act_scale
        plain = self.fewest(room, full + received, n)
        if not self.recompute:
            return plain
        # Recomputing: one checkpoint segment's activations, and the input (received with `transfers`, the same
        # bytes: counted once) and the checkpoints per microbatch in flight.
        kept = (cut[lo - 1] * self.b / problem.batch if lo > 0 else 0.0) + problem.checkpoint_bytes(lo, hi, self.b)
        rerun = self.fewest(room - problem.rerun_bytes(lo, hi, self.b), kept, n)
        return rerun if plain is None else plain if rerun is None else min(plain, rerun)

    def fewest(self, room: float, act: float, n: int) -> int | None:
        """The fewest replicas holding `act` bytes per microbatch in flight within `room`."""
        if room < 0:
            return None
        if in_flight(self.schedule, n, self.microbatches) * act <= room:
            return 1
        held = math.floor(room / act)
        if held < 1:
            return None
        # The fewest R with ceil(M / R) <= held: no schedule then holds more than `held`.
        return -(-self.microbatches // held)
