"""Recomputation choices: candidates that recompute every stage, or exactly the stages that do not fit
without it (`trim_recompute`)."""

from __future__ import annotations

import dataclasses

from dapple_ir.planner.cost_model import POLICIES, Candidate, Problem, evaluate, microbatch_choices
from dapple_ir.planner.dp import plan_dp, policies_for, replicated_pipelines
from dapple_ir.planner.gather import even_groups
from dapple_ir.planner.request import Request
from dapple_ir.planner.scoring import Scored


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
