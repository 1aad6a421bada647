"""Gathering candidates: what the DP, the ILP, the baselines and (when nothing fits) the memory-first
search propose for a request, with their replication twins, interleaved variants and schedule
variants, each with its cost-model estimate."""

from __future__ import annotations

import dataclasses
import math

from dapple_ir.planner.baselines import (
    all_baselines,
    interleaved_variant,
    time_balanced_partition,
    uniform_partition,
)
from dapple_ir.planner.cost_model import (
    POLICIES,
    Candidate,
    Problem,
    candidate,
    evaluate,
    microbatch_choices,
    with_replication,
)
from dapple_ir.planner.dp import plan_dp, policies_for, replicated_pipelines
from dapple_ir.planner.ilp import plan_ilp
from dapple_ir.planner.local_search import cluster_is_small
from dapple_ir.planner.memory_fit import leanest_plan
from dapple_ir.planner.request import RECOMPUTE_SCHEDULES, Request
from dapple_ir.planner.scoring import Scored, round_robin_priced

#: Card links up to which small instances search uncapped Pareto fronts (DAPPLE's 2x8 servers have 4).
EXACT_FRONT_CARDS = 8

#: Virtual stage counts `auto` (no schedule asked for) tries on its best 1f1b plans.
AUTO_VIRTUAL = (2, 4)


def gather(problem: Problem, req: Request, schedule: str) -> list[Scored]:
    """Every candidate the DP, the ILP, the baselines and (when nothing fits) the memory-first
    search propose for `req` under `schedule`, each with its cost-model estimate."""
    cluster = problem.cluster
    ms = [req.microbatches] if req.microbatches else microbatch_choices(problem.global_batch, cluster.num_devices)
    policies = [req.policy] if req.policy else policies_for(cluster, POLICIES)
    pool: list[Scored] = []
    if req.stages is None and req.microbatches is None and req.policy is None:
        for name, (cand, _est) in all_baselines(problem).items():
            cand = Candidate(cand.stages, cand.microbatches, schedule, cand.policy, f"baseline:{name}")
            pool.append(Scored(cand, evaluate(problem, cand)))
    bound = min((s.estimate.iteration_s for s in pool if s.estimate.fits), default=math.inf)
    if req.method in ("dp", "auto"):
        # Small instances get uncapped Pareto fronts: the DP is then exact for the cost model. Not
        # with many network cards: a front over every card's load grows too large to search (with
        # per-call fixed costs, 8 layers on 16 one-device nodes took 35 s uncapped, 0.1 s capped).
        small = problem.layers * cluster.num_devices <= 128 and len(problem.network.card_links) <= EXACT_FRONT_CARDS
        front = None if small else 3
        # DAPPLE's split replication; with `auto` on clusters the local search covers, round robin too
        # (VGG-19 at 512 on 2x8 V100: 15,1 round robin at 128 microbatches beats every split plan).
        splits = {"split": [True], "round-robin": [False]}.get(
            req.replication, [True, False][: 1 + cluster_is_small(problem)]
        )
        for split in splits:
            for cand, est in plan_dp(
                problem,
                microbatches=ms,
                schedules=[schedule],
                policies=policies,
                stages=req.stages,
                bound=bound * 1.25,
                front=front,
                split=split,
            ):
                pool.append(Scored(cand, est))
        if cluster.num_devices > 64 and req.stages is None and req.policy is None:
            for cand, est in replicated_pipelines(problem, microbatches=ms, schedule=schedule, bound=bound * 1.25):
                pool.append(Scored(cand, est))
    if req.method == "ilp" or (req.method == "auto" and problem.layers <= 24 and cluster.num_devices <= 16):
        seeds = plan_dp(problem, microbatches=ms, schedules=[schedule], policies=["append-first"], stages=req.stages)
        hints = [c for c, _est in seeds[:3]]
        for cand, est, note in plan_ilp(
            problem,
            microbatches=ms,
            schedule=schedule,
            stages=req.stages,
            time_limit_s=req.ilp_time_limit_s,
            hints=hints,
        ):
            pool.append(Scored(cand, est, note=note))
    if not any(s.estimate.fits for s in pool) and req.microbatches is None and req.method != "ilp":
        # Smaller microbatches hold fewer activations: try the counts above the usual range.
        g = problem.global_batch
        larger = [m for m in (2**k for k in range(1, 16)) if max(ms) < m <= g and g % m == 0]
        larger += [problem.global_batch] if problem.global_batch not in larger else []
        for cand, est in plan_dp(
            problem, microbatches=larger[-4:], schedules=[schedule], policies=policies, stages=req.stages
        ):
            pool.append(Scored(cand, est))
    if not any(s.estimate.fits for s in pool):
        pool += leanest_candidates(problem, req, schedule)
    return pool


def replication_variants(problem: Problem, req: Request, pool: list[Scored]) -> list[Scored]:
    """The pool as `req.replication` asks: every candidate split (those that cannot are dropped) or
    round robin, or with `auto` both: each candidate and its twin, split where it can
    (`with_replication`) if it was round robin, else round robin. The DP searches with split stages
    (DAPPLE's replication, `dp.solve`); the twins let round robin win where it runs faster (a stage
    whose rows would be too few to keep the device busy: the fixed part of its time stays). `auto`
    adds only twins whose round robin the cost model prices (`round_robin_priced`)."""
    found = []
    for s in pool:
        mode = req.replication
        if mode == "auto":
            found.append(s)
            mode = "round-robin" if any(s.cand.split) else "auto"
        twin = with_replication(problem, s.cand, mode)
        if twin is None or (req.replication == "auto" and (twin.split == s.cand.split or not round_robin_priced(twin))):
            continue
        found.append(s if twin == s.cand else Scored(twin, evaluate(problem, twin)))
    return found


def even_groups(problem: Problem, req: Request) -> list[Scored]:
    """Pipelines of P equal device groups (every P dividing the devices, or the P asked for), each
    microbatch count the request allows: the device groupings interleaving is made for, which the
    1f1b search may not list when its best plans have group counts the microbatches do not divide."""
    n = problem.cluster.num_devices
    ms = [req.microbatches] if req.microbatches else microbatch_choices(problem.global_batch, n)
    found = []
    for p in [req.stages] if req.stages else [p for p in range(1, n + 1) if n % p == 0]:
        bounds = time_balanced_partition(problem, p)
        if bounds is None or n % p:
            continue
        for m in ms:
            cand = candidate(problem, bounds, [n // p] * p, m, "1f1b", req.policy or "append-first", "even-groups")
            if cand is not None:
                found.append(Scored(cand, evaluate(problem, cand)))
    return found


def forced_grid(problem: Problem, req: Request, schedule: str) -> list[Scored]:
    """With `data_parallel` D asked for: S stages of D replicas each (the S asked for, else every S that fits), cut
    at equal layer counts (Megatron-LM's rule) and at balanced times, for each microbatch count the request allows:
    the plans the searches, which choose replicas per stage, may not list."""
    d = req.data_parallel or 1
    n = problem.cluster.num_devices
    ms = [req.microbatches] if req.microbatches else microbatch_choices(problem.global_batch, n)
    found = []
    for p in [req.stages] if req.stages else range(1, n // d + 1):
        for partition in (uniform_partition, time_balanced_partition):
            bounds = partition(problem, p)
            if bounds is None:
                continue
            for m in ms:
                cand = candidate(problem, bounds, [d] * p, m, schedule, req.policy or "append-first", "forced-grid")
                if cand is not None:
                    found.append(Scored(cand, evaluate(problem, cand)))
    return found


def interleaved_variants(problem: Problem, bases: list[Scored], *virtuals: int) -> list[Scored]:
    """The interleaved variants (`baselines.interleaved_variant`) of every distinct device grouping
    and microbatch count among `bases`, with each of `virtuals` stages per group."""
    seen, found = set(), []
    for s in bases:
        key = (tuple(st.devices for st in s.cand.stages), s.cand.microbatches)
        if key in seen:
            continue
        seen.add(key)
        for virtual in virtuals:
            cand = interleaved_variant(problem, s.cand, virtual)
            if cand is not None:
                found.append(Scored(cand, evaluate(problem, cand)))
    return found


def schedule_variants(problem: Problem, best: list[Scored], *, interleave: bool = True) -> list[Scored]:
    """The best 1f1b plans again under zb-h1 (weight gradients fill bubbles), gpipe (no early
    backward: fewer waits between unevenly replicated stages, more memory) and interleaved with
    `AUTO_VIRTUAL` stages per device group (a bubble V times smaller, V times the transfers; not with
    `interleave` false, when the stage count is forced), where they fit; the simulator tells which
    order of the same work runs fastest."""
    variants = []
    for s in best:
        if s.cand.schedule != "1f1b":
            continue
        if interleave and not any(s.cand.recompute):
            variants += [v for v in interleaved_variants(problem, [s], *AUTO_VIRTUAL) if v.estimate.fits]
        for schedule in ("zb-h1", "gpipe"):
            if any(s.cand.recompute) and schedule not in RECOMPUTE_SCHEDULES:
                continue
            cand = dataclasses.replace(s.cand, schedule=schedule, source=f"{s.cand.source}+{schedule}")
            estimate = evaluate(problem, cand)
            if estimate.fits:
                variants.append(Scored(cand, estimate))
    return variants


def leanest_candidates(problem: Problem, req: Request, schedule: str) -> list[Scored]:
    """When nothing else fits: for each microbatch count, the candidate that fits on the fewest
    devices counting what its rank programs receive too (`memory_fit.leanest_plan`), and copies of
    it over the devices left (more replicas hold fewer microbatches each)."""
    g, n = problem.global_batch, problem.cluster.num_devices
    found = []
    for m in [req.microbatches] if req.microbatches else divisors(g):
        lean = leanest_plan(problem, m, schedule, req.stages, transfers=True)
        if lean is None or lean.devices > n:
            continue
        copies = n // lean.devices
        for k in sorted({1, *(2**e for e in range(copies.bit_length())), copies}):
            replicas = [r * k for r in lean.replicas]
            cand = candidate(
                problem, list(lean.bounds), replicas, m, schedule, req.policy or "append-first", "memory-first"
            )
            if cand is not None:
                found.append(Scored(cand, evaluate(problem, cand)))
    return found


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
