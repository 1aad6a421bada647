"""The local search: hill-climbing in the simulator from the best simulated plans, one step (microbatch
count, schedule, replication, a cut moved by a layer) at a time."""

from __future__ import annotations

import dataclasses

from dapple_ir.planner.cost_model import Candidate, Problem, StageChoice, evaluate, with_replication
from dapple_ir.planner.request import RECOMPUTE_SCHEDULES, Request
from dapple_ir.planner.scoring import Score, Scored, plan_key, round_robin_priced, score_best

#: The local search around the best simulated plans (`local_search`): rounds, plans continued from
#: per round, the most stages whose cuts it moves, and the largest cluster it runs on (beyond it a
#: simulation costs seconds).
LOCAL_ROUNDS = 3
LOCAL_WIDTH = 2
LOCAL_CUT_STAGES = 4
LOCAL_DEVICES = 64


def cluster_is_small(problem: Problem) -> bool:
    """Whether simulating a plan is cheap enough for the local search (`LOCAL_DEVICES`)."""
    return problem.cluster.num_devices <= LOCAL_DEVICES


def local_search(
    problem: Problem, req: Request, timed: list[Scored], known: list[Scored], score: Score, cap: float
) -> list[Scored]:
    """Hill-climb in the simulator from the best simulated plans. The searches rank by the cost
    model, which misjudges some plans (round-robin replicas of uneven counts wait on each other in
    ways its formula does not see: VGG-19 at global batch 1024 on 2x8 V100 estimates 11,4,1 replicas
    at 343 ms, simulated 409 ms, while 15,1 cut one layer later simulates 391 ms under gpipe). Each
    climb starts from one of the `LOCAL_WIDTH` best, the best round robin and the best baseline (each
    a basin of its own: VGG-19's 15,1 round robin at 512 on 2x8 V100 lies several steps from the
    split plans the model ranks first), simulates its neighbours (`_neighbours`) and goes on from the
    best of them while it beats where the climb stands, for at most `LOCAL_ROUNDS` rounds. Returns the
    neighbours simulated that fit in device memory."""
    seen = {plan_key(s.cand) for s in known}
    found: list[Scored] = []
    starts = timed[:LOCAL_WIDTH]
    for basin in (lambda s: not any(s.cand.split), lambda s: s.cand.source.startswith("baseline:")):
        starts += [s for s in timed if basin(s) and s not in starts][:1]
    for start in starts:
        here = start
        for _ in range(LOCAL_ROUNDS):
            near = _neighbours(problem, req, here.cand, seen)
            score_best(problem, near, score)
            near = [n for n in near if n.simulated_s is not None and (n.simulated_peak or 0.0) <= cap]
            found += near
            better = min(near, key=lambda n: n.time_s, default=None)
            if better is None or better.time_s >= here.time_s:
                break
            here = better
    return found


def _neighbours(problem: Problem, req: Request, cand: Candidate, seen: set[tuple]) -> list[Scored]:
    """The plans one step from `cand` that fit and were not seen: half and twice the microbatches
    (under every schedule the request allows where the cluster prices a split backward), another
    schedule, split replication toggled (round robin, or split where it can), and (up to
    `LOCAL_CUT_STAGES` stages) one cut moved by a layer; what the request fixes stays fixed, and a
    forced stage count keeps the searches' cuts too (it is how a split is reproduced to compare
    systems: bench/runtime_vs_torch_pipelining.py cuts torch where we cut, which must be a module's
    edge). Interleaved plans have no neighbours."""
    if cand.virtual != 1:
        return []
    options: list[Candidate] = []
    allowed = RECOMPUTE_SCHEDULES if any(cand.recompute) else ("1f1b", "gpipe", "zb-h1")
    if req.microbatches is None:
        # Where the cluster prices zb-h1's split backward or the host's work per instruction, with each schedule:
        # whether zb-h1 wins then moves with the microbatch count (its split and its extra instruction cost per
        # microbatch, its bubble shrinks with more of them),
        # and a climb that changes one at a time stops short. Elsewhere one at a time (each move is a
        # simulation: every schedule at both counts made the search 1.5x slower on the published profiles).
        priced = any(k.prices_split or k.prices_host for k in problem.cluster.node_kinds)
        schedules = (
            [cand.schedule, *(k for k in allowed if k != cand.schedule)] if req.schedule is None and priced else []
        )
        for m in (cand.microbatches // 2, cand.microbatches * 2):
            if 1 <= m <= problem.global_batch and problem.global_batch % m == 0:
                options += [
                    dataclasses.replace(
                        cand, microbatches=m, schedule=k, source=f"{cand.source}~M{m}" + f"~{k}" * (k != cand.schedule)
                    )
                    for k in schedules or [cand.schedule]
                ]
    if req.replication == "auto":
        twin = with_replication(problem, cand, "round-robin" if any(cand.split) else "auto")
        if twin is not None and twin.split != cand.split and round_robin_priced(twin):
            options.append(dataclasses.replace(twin, source=f"{cand.source}~{'rr' if any(cand.split) else 'split'}"))
    if req.schedule is None:
        options += [
            dataclasses.replace(cand, schedule=k, source=f"{cand.source}~{k}") for k in allowed if k != cand.schedule
        ]
    if req.stages is None and len(cand.stages) <= LOCAL_CUT_STAGES:
        for k in range(len(cand.stages) - 1):
            a, b = cand.stages[k], cand.stages[k + 1]
            for step in (-1, 1):
                if a.lo < a.hi + step < b.hi:
                    moved = (StageChoice(a.lo, a.hi + step, a.devices), StageChoice(a.hi + step, b.hi, b.devices))
                    stages = cand.stages[:k] + moved + cand.stages[k + 2 :]
                    options.append(dataclasses.replace(cand, stages=stages, source=f"{cand.source}~cut{k}{step:+d}"))
    near = []
    for option in options:
        key = plan_key(option)
        size = problem.microbatch_size(option.microbatches)
        # More microbatches are smaller: a split stage needs a sample of each per replica; a moved cut
        # may put a split stage beside a cut it cannot slice.
        splits = [st for k, st in enumerate(option.stages) if option.splits(k)]
        if key in seen or any(st.replicas > size or not problem.can_split(st.lo, st.hi) for st in splits):
            continue
        seen.add(key)
        estimate = evaluate(problem, option)
        if estimate.fits:
            near.append(Scored(option, estimate))
    return near
