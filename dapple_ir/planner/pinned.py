"""Candidates with the user's cuts (`Request.cuts`, from `--split-at`) where the searches (DP, ILP) propose
none that fit there (`ranking.candidates` keeps theirs first): the stages are fixed, and the search is over
replica counts, placement and microbatches (replication mode, recomputation and schedule
are varied afterwards as for every candidate). The replica counts are those a walk from one device per
stage passes through, each step giving one more device to the stage with the most work per replica,
and equal counts where the devices divide evenly: the allocations a bottleneck-driven planner would weigh,
O(devices) of them rather than every composition."""

from __future__ import annotations

import itertools

from dapple_ir.planner.cost_model import POLICIES, Candidate, Problem, candidate, evaluate, microbatch_choices
from dapple_ir.planner.dp import policies_for
from dapple_ir.planner.request import Request
from dapple_ir.planner.scoring import Scored

#: The source of the candidates proposed here (the explain table's column).
PINNED_SOURCE = "split-at"


def pinned_candidates(problem: Problem, req: Request, schedule: str) -> list[Scored]:
    """Every candidate with `req.cuts` as its cuts, over `replica_choices`, the microbatch counts and the
    policies the request allows, round robin (`ranking` adds the split twins); when none fits, again
    at the larger microbatch counts (smaller microbatches hold fewer activations)."""
    bounds = [0, *req.cuts, problem.layers]
    g, n = problem.global_batch, problem.cluster.num_devices
    ms = [req.microbatches] if req.microbatches else microbatch_choices(g, n)
    found = _at(problem, req, schedule, bounds, ms)
    if req.microbatches is None and not any(s.estimate.fits for s in found):
        larger = [m for m in range(max(ms) + 1, g + 1) if g % m == 0]
        found += _at(problem, req, schedule, bounds, larger[:4] + larger[-2:])
    return found


def _at(problem: Problem, req: Request, schedule: str, bounds: list[int], ms: list[int]) -> list[Scored]:
    policies = [req.policy] if req.policy else policies_for(problem.cluster, POLICIES)
    found = []
    for replicas in replica_choices(problem, bounds):
        for m in dict.fromkeys(ms):
            for policy in policies:
                cand = candidate(problem, bounds, list(replicas), m, schedule, policy, PINNED_SOURCE)
                if cand is not None:
                    found.append(Scored(cand, evaluate(problem, cand)))
    return found


def replica_choices(problem: Problem, bounds: list[int]) -> list[tuple[int, ...]]:
    """Replica counts per stage of the cuts `bounds`: the bottleneck walk from one each to every
    device (see the module docstring), and equal counts when the stages divide the devices."""
    n, stages = problem.cluster.num_devices, len(bounds) - 1
    work = [sum(problem.fwd_s[lo:hi]) + sum(problem.bwd_s[lo:hi]) for lo, hi in itertools.pairwise(bounds)]
    replicas = [1] * stages
    found = [tuple(replicas)] if stages <= n else []
    while stages <= sum(replicas) < n:
        busiest = max(range(stages), key=lambda k: work[k] / replicas[k])
        replicas[busiest] += 1
        found.append(tuple(replicas))
    if n % stages == 0:
        found.append((n // stages,) * stages)
    return list(dict.fromkeys(found))


def keeps_cuts(cand: Candidate, req: Request) -> bool:
    """Whether `cand` cuts exactly where `req` pins the cuts (always, when it pins none)."""
    return not req.cuts or tuple(st.lo for st in cand.stages[1:]) == req.cuts
