"""Ranking: the candidates gathered for a request, checked against memory, the best few scored (and the
local search around them), ranked, and explained; when nothing fits, `NoPlanFits` says why."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from dapple_ir.errors import PlanError
from dapple_ir.planner.cost_model import Candidate, Problem
from dapple_ir.planner.explain import explain_lines
from dapple_ir.planner.gather import (
    even_groups,
    forced_grid,
    gather,
    interleaved_variants,
    leanest_candidates,
    replication_variants,
    schedule_variants,
)
from dapple_ir.planner.local_search import cluster_is_small, local_search
from dapple_ir.planner.pinned import keeps_cuts, pinned_candidates
from dapple_ir.planner.recompute import rebalanced, recompute_variants
from dapple_ir.planner.request import RECOMPUTE_SCHEDULES, Request, validate, virtual_choices
from dapple_ir.planner.scoring import Score, Scored, SearchProgress, score_best, unique
from dapple_ir.planner.zero import zero_variants
from dapple_ir.units import GB

#: How many of the best candidates `auto` lowers and simulates.
SIMULATED = 4


@dataclass
class Outcome:
    chosen: Scored
    considered: list[Scored] = field(default_factory=list)
    explain: list[str] = field(default_factory=list)


class NoPlanFits(PlanError):
    """No candidate fits in memory: the message says how far the leanest is from fitting; `search`
    adds the memory advice."""


def rank(problem: Problem, req: Request, score: Score | None = None) -> Outcome:
    """The best fitting plan for `problem`, with the candidates that lost and why; `NoPlanFits` when
    none fits (`search` is this with the memory advice).

    With `score`, the best few candidates by the cost model (and every baseline) are scored and ranked
    by it; without, the cost model alone ranks them. A schedule the cost model has no formula for (one
    a plugin registers) is estimated like 1f1b, and only the score tells it apart.
    """
    if req.cuts:
        req = dataclasses.replace(req, stages=req.stages or len(req.cuts) + 1)
    validate(problem, req)
    # With pinned cuts, the searches' plans there and the walk over replica counts there are ranked
    # apart (so that pinning a plan's own cuts finds that plan again), and the faster is chosen.
    proposers: list[Proposer] = [gather, pinned_candidates] if req.cuts else [gather]
    progress = SearchProgress(req.progress) if req.progress is not None else None
    if progress is not None and score is not None:
        score = progress.counting(score)
    outcomes, failure = [], None
    for propose in proposers:
        try:
            schedule, pool = candidates(problem, req, propose)
            if progress is not None:
                progress.found(len(pool))
            outcomes.append(_rank_pool(problem, req, score, schedule, pool))
        except NoPlanFits as exc:
            failure = exc
    if not outcomes and failure is not None:
        raise failure
    return min(outcomes, key=lambda outcome: outcome.chosen.time_s)


def _rank_pool(problem: Problem, req: Request, score: Score | None, schedule: str, pool: list[Scored]) -> Outcome:
    fitting = sorted((s for s in pool if s.estimate.fits), key=lambda s: s.estimate.iteration_s)
    if not fitting:
        raise NoPlanFits(no_fit_text(problem, pool))
    # The best few by the model, and every baseline, so that the plan shown is never slower in the
    # simulator than a rule a user could apply by hand.
    head = [s for k, s in enumerate(fitting) if k < SIMULATED or s.cand.source.startswith("baseline:")]
    if req.replication == "auto":
        # The best round robin too: the model can favour split plans the simulator finds slower.
        head += [s for s in fitting if not any(s.cand.split) and s not in head][:2]
    tail = [s for s in fitting if s not in head]
    if score is not None and req.schedule is None:
        head += schedule_variants(problem, fitting[:2], interleave=req.stages is None and req.virtual != 1)
    if score is not None:
        score_best(problem, head, score)
    cap = problem.capacity(0)
    for s in head:
        if s.simulated_peak is not None and s.simulated_peak > cap:
            s.note = f"simulated peak {s.simulated_peak / 1e9:.1f} GB exceeds {cap / 1e9:.1f} GB"
    over = [s for s in head if s.note.startswith("simulated peak")]
    # Simulated times first (the number the user is shown), then the unsimulated by the model.
    timed = sorted((s for s in head if s not in over and s.simulated_s is not None), key=lambda s: s.time_s)
    untimed = sorted((s for s in head if s not in over and s.simulated_s is None), key=lambda s: s.time_s)
    if score is not None and timed and cluster_is_small(problem):
        near = local_search(problem, req, timed, pool + head, score, cap)
        head += near
        timed = sorted(timed + near, key=lambda s: s.time_s)
    if score is not None and over and not timed and not untimed:
        # Every simulated candidate overflows once lowered (the cost model counts less than a rank
        # program holds): simulate more until one fits, so that `verify` accepts the plan chosen.
        lean = [s for s in leanest_candidates(problem, req, schedule) if keeps_cuts(s.cand, req)]
        timed, more_over = _first_accepted(problem, lean, tail, score, cap)
        tail = [s for s in tail if s not in timed and s not in more_over]
        over += more_over
    ranked = timed + untimed + tail
    if not ranked:
        raise NoPlanFits(no_fit_text(problem, pool))
    ranked += over
    chosen = ranked[0]
    rejected = [s for s in pool if not s.estimate.fits]
    return Outcome(chosen, ranked + rejected, explain_lines(problem, chosen, ranked, rejected))


Proposer = Callable[[Problem, Request, str], list[Scored]]
"""Proposes candidates for a request under a schedule: `gather.gather` (the searches and the baselines)
or `pinned.pinned_candidates` (replica counts at pinned cuts)."""


def candidates(problem: Problem, req: Request, propose: Proposer = gather) -> tuple[str, list[Scored]]:
    """(the schedule the candidates were gathered under, every candidate once) for `req`: those `propose`
    gives, as replication and recomputation allow, at the request's cuts when it pins them; with virtual
    stages, the device groups as the 1f1b search finds them, each cut into V stages per group."""
    schedule = req.schedule or "1f1b"
    virtuals = virtual_choices(problem, req)
    if virtuals:
        pool: list[Scored] = []
        bases: dict[int | None, list[Scored]] = {}
        for v in virtuals:
            groups = req.stages // v if req.stages else None
            if groups not in bases:
                base_req = dataclasses.replace(req, schedule="1f1b", stages=groups)
                bases[groups] = gather(problem, base_req, "1f1b") + even_groups(problem, base_req)
                if req.data_parallel:
                    bases[groups] += forced_grid(problem, base_req, "1f1b")
            pool += interleaved_variants(problem, bases[groups], v)
        pool = [s for s in pool if _keeps_replicas(s.cand, req)]
        if req.recompute != "none":
            pool = recompute_variants(problem, req, "interleaved", pool, search=False)
        return "1f1b", unique(zero_variants(problem, req, pool))
    found = [s for s in propose(problem, req, schedule) if keeps_cuts(s.cand, req)]
    if req.data_parallel:
        found = [s for s in found + forced_grid(problem, req, schedule) if _keeps_replicas(s.cand, req)]
    pool = replication_variants(problem, req, found)
    if req.recompute != "none" and schedule in RECOMPUTE_SCHEDULES:
        pool = recompute_variants(problem, req, schedule, pool)
    pool = zero_variants(problem, req, pool)
    if not req.cuts:
        pool = rebalanced(problem, req, pool)
    # Recomputation's own searches propose cuts of their own: with pinned cuts, only those stay.
    return schedule, unique([s for s in pool if keeps_cuts(s.cand, req)])


def _keeps_replicas(cand: Candidate, req: Request) -> bool:
    """Does `cand` give every stage the replicas `req.data_parallel` asks for (or does the request leave them free)?"""
    return req.data_parallel is None or all(st.replicas == req.data_parallel for st in cand.stages)


def _first_accepted(
    problem: Problem, lean: list[Scored], tail: list[Scored], score: Score, cap: float
) -> tuple[list[Scored], list[Scored]]:
    """([the first candidate whose simulated peak fits], [those simulated that did not]): the
    memory-first ones (built to fit once lowered), then the rest, each by the model's time;
    at most 2 x SIMULATED simulations."""
    rejected: list[Scored] = []
    order = sorted((c for c in lean if c.estimate.fits), key=lambda c: c.estimate.iteration_s) + tail
    for s in order[: 2 * SIMULATED]:
        score_best(problem, [s], score)
        if s.simulated_peak is None or s.simulated_peak <= cap:
            return [s], rejected
        s.note = f"simulated peak {s.simulated_peak / 1e9:.1f} GB exceeds {cap / 1e9:.1f} GB"
        rejected.append(s)
    return [], rejected


def no_fit_text(problem: Problem, pool: list[Scored]) -> str:
    """Why nothing fits on this cluster: what the model's state takes, and the leanest candidate's peak."""
    cluster = problem.cluster
    cap = problem.capacity(0)
    least = min((s.estimate.peak_bytes for s in pool), default=math.inf)
    return (
        f"no plan fits in memory on {cluster.name} ({cluster.num_devices} x {cap / GB:.1f} GB) for global batch "
        f"{problem.global_batch}: parameters, gradients and optimizer state take {problem.ps[-1] / GB:.1f} GB in all"
        + (f", and the leanest candidate still needs {least / GB:.1f} GB on one device" if least < math.inf else "")
        + "."
    )
