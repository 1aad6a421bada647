"""Plans a user could make by hand, and PipeDream's planner, for the same cost model and simulator.

Every baseline picks its stage count among powers of two and its microbatch count among
`microbatch_choices` by the cost model (a user tuning two knobs), replicating the whole pipeline
over the remaining devices, so the comparison is with each rule at its best.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

from dapple_ir.planner.cost_model import (
    Candidate,
    Estimate,
    Problem,
    StageChoice,
    candidate,
    evaluate,
    microbatch_choices,
)


def _microbatches(problem: Problem) -> list[int]:
    """The usual counts, and larger ones a user would try when activations do not fit."""
    usual = microbatch_choices(problem.global_batch, problem.cluster.num_devices)
    g = problem.global_batch
    larger = [m for m in (2**k for k in range(1, 16)) if max(usual) < m <= g and g % m == 0]
    larger += [problem.global_batch] if problem.global_batch not in (*usual, *larger) else []
    return usual + larger[-2:]


Partition = Callable[[Problem, int], list[int] | None]
"""Cut points [0, ..., L] of `S` contiguous stages, or None when there are fewer layers than S."""


def uniform_partition(problem: Problem, stages: int) -> list[int] | None:
    """Equal layer counts (the first stages take one more layer when L is not divisible)."""
    layers = problem.layers
    if stages > layers:
        return None
    return [round(k * layers / stages) for k in range(stages + 1)]


def _min_max_partition(weights: list[float], stages: int) -> list[int] | None:
    """Contiguous split of `weights` into `stages` non-empty parts minimising the heaviest part
    (the block partition torchgpipe's balance_by_time solves), by dynamic programming."""
    n = len(weights)
    if stages > n:
        return None
    cut = _min_max_table(tuple(weights), stages)
    bounds, j = [n], n
    for k in range(stages, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    return bounds[::-1]


@lru_cache(maxsize=8)
def _min_max_table(weights: tuple[float, ...], stages: int) -> list[list[int]]:
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        previous, row, cuts = best[k - 1], best[k], cut[k]
        for j in range(k, n + 1):
            pj = prefix[j]
            # The last part [i, j) only grows lighter as i moves right: stop once it beats the rest.
            for i in range(j - 1, k - 2, -1):
                part = pj - prefix[i]
                value = previous[i] if previous[i] > part else part
                if value < row[j]:
                    row[j], cuts[j] = value, i
                if part >= row[j]:
                    break
    return cut


def time_balanced_partition(problem: Problem, stages: int) -> list[int] | None:
    return _min_max_partition([f + b for f, b in zip(problem.fwd_s, problem.bwd_s, strict=True)], stages)


def parameter_balanced_partition(problem: Problem, stages: int) -> list[int] | None:
    return _min_max_partition(problem.grad_bytes, stages)


def _best(problem: Problem, options: list[Candidate]) -> tuple[Candidate, Estimate] | None:
    scored = [(c, evaluate(problem, c)) for c in options]
    if not scored:
        return None
    return min(scored, key=lambda ce: (not ce[1].fits, ce[1].iteration_s))


def replicated_pipeline(
    problem: Problem, partition: Partition, name: str, schedule: str = "1f1b"
) -> tuple[Candidate, Estimate] | None:
    """`partition` into S stages (S a power of two dividing the devices), the pipeline copied N/S times."""
    n = problem.cluster.num_devices
    options = []
    stages = 1
    while stages <= min(n, problem.layers):
        bounds = partition(problem, stages)
        if bounds is not None and n % stages == 0:
            copies = n // stages
            for m in _microbatches(problem):
                cand = candidate(problem, bounds, [copies] * stages, m, schedule, "append-first", f"baseline:{name}")
                if cand is not None:
                    options.append(cand)
        stages *= 2
    return _best(problem, options)


def data_parallel(problem: Problem, schedule: str = "1f1b") -> tuple[Candidate, Estimate] | None:
    """One stage on every device; gradient accumulation over M / N microbatches per device."""
    n = problem.cluster.num_devices
    options = []
    for m in _microbatches(problem):
        replicas = min(n, m)
        cand = candidate(
            problem, [0, problem.layers], [replicas], m, schedule, "append-first", "baseline:data-parallel"
        )
        if cand is not None:
            options.append(cand)
    return _best(problem, options)


def pipedream(problem: Problem, schedule: str = "1f1b") -> tuple[Candidate, Estimate] | None:
    """PipeDream's planner (SOSP'19, §3.1), run as a synchronous 1F1B pipeline."""
    options = []
    found = pipedream_stages(problem)
    if found is None:
        return None
    bounds, replicas = found
    for m in _microbatches(problem):
        cand = candidate(problem, bounds, replicas, m, schedule, "append-first", "baseline:pipedream")
        if cand is not None:
            options.append(cand)
    return _best(problem, options)


def interleaved_variant(problem: Problem, base: Candidate, virtual: int) -> Candidate | None:
    """`base`'s device groups and microbatches with `virtual` stages each (Megatron's interleaved
    placement: the layers cut into S = P V time-balanced stages, stage k on the devices of base stage
    k % P), or None where that is not worth a candidate: fewer than two groups (no bubble to
    shrink), groups of unequal replica counts, M not a multiple of P R (each replica then runs
    Megatron's order over its own M / R microbatches, `schedules.interleaved`), too few layers."""
    p = len(base.stages)
    m = base.microbatches
    replicas = set(base.replicas)
    if virtual < 2 or p < 2 or len(replicas) != 1 or m % (p * replicas.pop()):
        return None
    bounds = time_balanced_partition(problem, p * virtual)
    if bounds is None:
        return None
    stages = tuple(StageChoice(bounds[k], bounds[k + 1], base.stages[k % p].devices) for k in range(p * virtual))
    source = f"{base.source}+v{virtual}"
    return Candidate(stages, m, "interleaved", base.policy, source, virtual)


BASELINES: dict[str, Callable[[Problem], tuple[Candidate, Estimate] | None]] = {
    "data-parallel": data_parallel,
    "uniform": lambda p: replicated_pipeline(p, uniform_partition, "uniform"),
    "parameter-balanced": lambda p: replicated_pipeline(p, parameter_balanced_partition, "parameter-balanced"),
    "time-balanced": lambda p: replicated_pipeline(p, time_balanced_partition, "time-balanced"),
    "pipedream": pipedream,
}


def all_baselines(problem: Problem) -> dict[str, tuple[Candidate, Estimate]]:
    """Each baseline's best candidate (where it has one), by name."""
    result = {}
    for name, make in BASELINES.items():
        found = make(problem)
        if found is not None:
            result[name] = found
    return result


def pipedream_stages(problem: Problem) -> tuple[list[int], list[int]] | None:
    """PipeDream's optimizer: A(j, m), the slowest stage of the best pipeline over layers [0, j)
    on m workers, is min over the last stage [i, j) with m' replicas of
    max(A(i, m - m'), 2 * cut_i / B, T(i, j, m')), where a stage replicated m' times takes
    T = max(compute, 4 (m' - 1) |w| / (m' B)) / m' (weight synchronisation included). B is the
    intra-node bandwidth for replica groups and cuts inside a node, else inter-node: the
    hierarchy of the paper, flattened. Memory is not modelled (PipeDream's optimizer ignores it)."""
    cluster = problem.cluster
    n, layers = cluster.num_devices, problem.layers
    step = 1
    while n // step > 16:
        step *= 2
    workers = list(range(step, n + 1, step))
    per_node = cluster.devices_per_node

    def bandwidth(m: int) -> float:
        return (cluster.intra if m <= per_node else cluster.inter).bandwidth

    def stage_time(i: int, j: int, m: int) -> float:
        compute = problem.pf[j] - problem.pf[i] + problem.pb[j] - problem.pb[i]
        sync = 4 * (m - 1) * (problem.pg[j] - problem.pg[i]) / (m * bandwidth(m))
        return max(compute, sync) / m

    cut_bw = cluster.intra.bandwidth if n <= per_node else cluster.inter.bandwidth
    count = len(workers)
    # best[j][k]: (A(j, workers[k]), i, m') of the best split; candidates are scanned in the paper's
    # order (i, then m' ascending) and only a strictly smaller value replaces the best so far.
    best: list[list[tuple[float, int, int]]] = [[]]
    for j in range(1, layers + 1):
        row = [(stage_time(0, j, m), 0, m) for m in workers]
        values = [v for v, _i, _m in row]
        for i in range(1, j):
            cut = 2 * problem.cut_bytes[i - 1] * problem.cost_batch / problem.batch / cut_bw
            times = [stage_time(i, j, m2) for m2 in workers]
            before = best[i]
            for k in range(1, count):
                value = values[k]
                if cut >= value:  # every candidate of this i is at least the cut: none is smaller
                    continue
                for q in range(k):
                    t = times[q]
                    if t >= value:
                        continue
                    candidate_value = max(before[k - q - 1][0], cut, t)
                    if candidate_value < value:
                        value = candidate_value
                        row[k] = (value, i, workers[q])
                values[k] = value
        best.append(row)
    bounds, replicas = [layers], []
    j, k = layers, count - 1
    while j > 0:
        _, i, m2 = best[j][k]
        bounds.append(i)
        replicas.append(m2)
        j, k = i, k - m2 // step
    return bounds[::-1], replicas[::-1]
