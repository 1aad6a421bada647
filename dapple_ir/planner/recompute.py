"""Recomputation choices: candidates that recompute every stage, or exactly the stages that do not fit
without it (`trim_recompute`), and the best of those with their cuts moved so that the stages that recompute
take fewer layers than those that do not (`rebalanced`)."""

from __future__ import annotations

import dataclasses
import itertools
import math

from dapple_ir.planner.cost_model import (
    POLICIES,
    Candidate,
    Problem,
    StageChoice,
    evaluate,
    microbatch_choices,
    stage_memory,
    stage_rows,
)
from dapple_ir.planner.dp import plan_dp, policies_for, replicated_pipelines
from dapple_ir.planner.gather import even_groups
from dapple_ir.planner.request import RECOMPUTE_SCHEDULES, Request
from dapple_ir.planner.scoring import Scored
from dapple_ir.pricing.pipeline import replica_in_flight

#: How many of the fastest fitting recomputing candidates (by the model) `rebalanced` re-cuts.
REBALANCED = 8


def recompute_variants(
    problem: Problem, req: Request, schedule: str, pool: list[Scored], *, search: bool = True
) -> list[Scored]:
    """The pool with recomputation: `all` turns it on in every stage of every candidate; `auto` adds
    the DP's plans where every stage may recompute (each trimmed to the stages that need it,
    `trim_recompute`) and, for every candidate that does not fit, the same plan recomputing the stages
    that do not fit without. The DP in recompute mode runs only when nothing fits without
    recomputation: run always (pruned by the best plan's time), it found no faster plan on any shipped
    profile on 1x8xV100 and cost up to 45% more search time (GNMT-16 on 2x8xV100). Without `search`
    (interleaved pools, whose cuts come from 1f1b's), the pool's own candidates only."""
    if req.recompute == "all":
        everywhere = [dataclasses.replace(s.cand, recompute=(True,) * len(s.cand.stages)) for s in pool]
        pool = [Scored(c, evaluate(problem, c)) for c in everywhere]
        return pool + (_recompute_gather(problem, req, schedule, trim=False) if search else [])
    extra = []
    for s in pool:
        if not s.estimate.fits:
            trimmed = trim_recompute(problem, s.cand, everywhere=True)
            if trimmed is not None:
                extra.append(trimmed)
    if search and not any(s.estimate.fits for s in pool):
        extra += _recompute_gather(problem, req, schedule, trim=True)
    return pool + extra


def _recompute_gather(problem: Problem, req: Request, schedule: str, *, trim: bool) -> list[Scored]:
    """The DP's candidates with every stage allowed to recompute (`dp.solve(recompute=True)`) and the
    even pipelines (`even_groups`: P time-balanced stages of N / P replicas each) recomputing, trimmed to
    the stages that need it when `trim`. The even pipelines are there for the simulator to rank: with
    replica counts that differ between stages the model's time can be far off (Llama-2-70B on 8x8xH100:
    the DP's plan is estimated at 50 s and simulates at 105 s, 32 even stages of 2 at 63 and 64 s)."""
    cluster = problem.cluster
    ms = [req.microbatches] if req.microbatches else microbatch_choices(problem.global_batch, cluster.num_devices)
    policies = [req.policy] if req.policy else policies_for(cluster, POLICIES)
    found = plan_dp(
        problem,
        microbatches=ms,
        schedules=[schedule],
        policies=policies,
        stages=req.stages,
        recompute=True,
        split=req.replication != "round-robin",
    )
    if cluster.num_devices > 64 and req.stages is None and req.policy is None:
        found += replicated_pipelines(problem, microbatches=ms, schedule=schedule, recompute=True)
    for even in even_groups(problem, req):
        cand = dataclasses.replace(even.cand, schedule=schedule, recompute=(True,) * len(even.cand.stages))
        found.append((cand, evaluate(problem, cand)))
    pool = []
    for cand, est in found:
        trimmed = trim_recompute(problem, cand) if trim else None
        pool.append(trimmed or Scored(cand, est))
    return pool


def trim_recompute(problem: Problem, cand: Candidate, *, everywhere: bool = False) -> Scored | None:
    """`cand` recomputing exactly the stages that do not fit without it (starting from every stage with
    `everywhere`, else from the candidate's own choice), or None when it still does not fit. Turning it
    off where a stage fits only saves time, and never changes another stage's memory."""
    start = dataclasses.replace(cand, recompute=(True,) * len(cand.stages)) if everywhere else cand
    if not evaluate(problem, start).fits:
        return None
    without = evaluate(problem, dataclasses.replace(cand, recompute=()))
    needed = tuple(
        start.recomputes(k) and peak > capacity
        for k, (peak, capacity) in enumerate(zip(without.stage_peak_bytes, without.stage_capacity, strict=True))
    )
    trimmed = dataclasses.replace(cand, recompute=needed if any(needed) else ())
    return Scored(trimmed, evaluate(problem, trimmed))


def rebalanced(problem: Problem, req: Request, pool: list[Scored]) -> list[Scored]:
    """The pool and, for each of the `REBALANCED` fastest fitting candidates that recompute some stage (1f1b or
    gpipe, no virtual stages), the same devices, microbatches and sharding with new cuts and a new choice of the
    stages that recompute (`recut`), where the model finds it faster and it fits. A candidate's cuts balance its
    stages' times with the recomputation it was proposed with (every stage, or `trim_recompute`'s), but once its
    optimizer state is sharded (`zero_variants`) or its later stages, which hold fewer microbatches in flight, fit
    without rerunning their forward, those stages are a quarter faster: they can take more layers, and the
    stages that still recompute fewer. Only with `recompute=auto` (`all` asks for every stage)."""
    if req.recompute != "auto":
        return pool
    fitting = sorted(
        (
            s
            for s in pool
            if s.estimate.fits and any(s.cand.recompute) and s.cand.virtual == 1
            and s.cand.schedule in RECOMPUTE_SCHEDULES
        ),
        key=lambda s: s.estimate.iteration_s,
    )  # fmt: skip
    extra = []
    for s in fitting[:REBALANCED]:
        cand = recut(problem, s.cand)
        if cand is None or cand == s.cand:
            continue
        est = evaluate(problem, cand)
        if est.fits and est.iteration_s < s.estimate.iteration_s:
            extra.append(Scored(cand, est))
    return pool + extra


def recut(problem: Problem, cand: Candidate) -> Candidate | None:
    """`cand`'s stages (devices, replication, sharding kept) cut anew to make the busiest stage's work per iteration
    least, each stage recomputing only where it does not fit without (`stage_memory`, at its microbatches in flight):
    the least bound on a stage's work that a greedy cut meets (each stage takes the most layers it can within the
    bound and its memory, leaving a layer for each stage after it), by bisection. None where no cut fits."""
    n, layers = len(cand.stages), problem.layers
    if n < 2 or layers < n:
        return None
    b = problem.microbatch_size(cand.microbatches)
    split = [cand.splits(k) for k in range(n)]
    held = replica_in_flight(cand.schedule, cand.replicas, split, cand.microbatches)
    work = [_StageWork(problem, cand, k, b, held[k]) for k in range(n)]
    # Above any stage's work: every layer, recomputed, on the stage of the most microbatches.
    bound = 2.0 * max(w.per * (2.0 * w.pf[layers] + w.pb[layers] + w.host) for w in work)
    best = _greedy(work, layers, bound)
    if best is None:
        return None
    low = 0.0
    for _ in range(40):
        mid = (low + bound) / 2
        found = _greedy(work, layers, mid)
        if found is None:
            low = mid
        else:
            bound, best = mid, found
        if bound - low <= 1e-4 * bound:
            break
    cuts, recompute = best
    stages = tuple(
        StageChoice(lo, hi, st.devices) for (lo, hi), st in zip(itertools.pairwise(cuts), cand.stages, strict=True)
    )
    flags = recompute if any(recompute) else ()
    return dataclasses.replace(cand, stages=stages, recompute=flags, source=cand.source + "+rc")


def _greedy(work: list[_StageWork], layers: int, bound: float) -> tuple[list[int], tuple[bool, ...]] | None:
    """(cuts, recompute per stage) of the greedy cut within `bound` (see `recut`), or None."""
    cuts, flags, lo = [0], [], 0
    for k, w in enumerate(work):
        last = layers - (len(work) - 1 - k)
        found = None
        for hi in range(lo + 1, last + 1) if k < len(work) - 1 else (layers,):
            seconds, rc = w.least(lo, hi)
            if seconds > bound:
                break
            found = (hi, rc)
        if found is None:
            return None
        lo = found[0]
        cuts.append(lo)
        flags.append(found[1])
    return cuts, tuple(flags)


class _StageWork:
    """Stage k of a candidate at other cuts: its work per iteration over [lo, hi) without recomputation where that
    fits, else with it (infinite where neither fits), as `cost_model.stage_price` prices the busy part but for the
    host's work, taken as two instructions with one message per neighbour (a constant per stage: it moves no cut that
    a change of layers would not; `evaluate` prices the re-cut candidate exactly)."""

    def __init__(self, problem: Problem, cand: Candidate, k: int, b: int, held: int) -> None:
        st = cand.stages[k]
        self.problem, self.cand, self.k, self.held = problem, cand, k, held
        self.rows = stage_rows(b, st.replicas, cand.splits(k))
        self.pf, self.pb = problem.times_at(self.rows)
        self.per = cand.microbatches if cand.splits(k) else -(-cand.microbatches // st.replicas)
        self.shards = st.replicas if cand.shards(k) else 1
        self.capacity = min(problem.capacity(d) for d in st.devices)
        neighbours = (k > 0) + (k < len(cand.stages) - 1)
        self.host = problem.host_s(st.devices, 2, neighbours)
        self.stages_after = len(cand.stages) - k
        self.splits = cand.splits(k)
        # The bisection asks for the same ranges again at every bound: each priced once.
        self.known: dict[tuple[int, int], tuple[float, bool]] = {}

    def least(self, lo: int, hi: int) -> tuple[float, bool]:
        """(work seconds, recomputes?) of layers [lo, hi) on this stage."""
        found = self.known.get((lo, hi))
        if found is None:
            found = self.known[(lo, hi)] = self._least(lo, hi)
        return found

    def _least(self, lo: int, hi: int) -> tuple[float, bool]:
        if self.splits and not self.problem.can_split(lo, hi):
            return math.inf, False
        fwd = self.pf[hi] - self.pf[lo]
        base = fwd + self.pb[hi] - self.pb[lo] + self.host
        for recompute in (False, True):
            peak = stage_memory(
                self.problem, lo, hi, self.cand.schedule, self.stages_after, self.per, self.rows, recompute,
                self.shards, self.held,
            )  # fmt: skip
            if peak <= self.capacity:
                return self.per * (base + (fwd if recompute else 0.0)), recompute
        return math.inf, True
