"""The planner's search: gather candidates (DP, ILP, baselines), check them, rank the best few by a
score the caller gives (the `plan` pass lowers and simulates them), and explain the choice. The
`plan` pass is a thin shell around `search`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from dapple_ir.cluster.spec import ClusterSpec, parse_shorthand
from dapple_ir.errors import DappleError, PlanError
from dapple_ir.ir import Module, Stage, StageAttrs
from dapple_ir.planner.baselines import all_baselines, interleaved_variant, time_balanced_partition
from dapple_ir.planner.cost_model import (
    POLICIES,
    REPLICATION,
    Candidate,
    Estimate,
    Problem,
    StageChoice,
    candidate,
    evaluate,
    microbatch_choices,
    with_replication,
)
from dapple_ir.planner.dp import plan_dp, policies_for, replicated_pipelines
from dapple_ir.planner.ilp import plan_ilp
from dapple_ir.planner.memory_fit import leanest_plan, tightest_layer
from dapple_ir.schedules import SCHEDULES, ScheduleRequest, build_schedule
from dapple_ir.units import GB

#: The search methods: the DP, the CP-SAT model, or both (`auto`, the best few ranked by the score).
METHODS = ("auto", "dp", "ilp")

#: How many of the best candidates `auto` lowers and simulates.
SIMULATED = 4
#: The local search around the best simulated plans (`_local_search`): rounds, plans continued from
#: per round, the most stages whose cuts it moves, and the largest cluster it runs on (beyond it a
#: simulation costs seconds).
LOCAL_ROUNDS = 3
LOCAL_WIDTH = 2
LOCAL_CUT_STAGES = 4
LOCAL_DEVICES = 64

#: The most virtual stages per device group an interleaved request without `virtual` tries.
MAX_VIRTUAL = 4

#: Card links up to which small instances search uncapped Pareto fronts (DAPPLE's 2x8 servers have 4).
EXACT_FRONT_CARDS = 8

#: Virtual stage counts `auto` (no schedule asked for) tries on its best 1f1b plans.
AUTO_VIRTUAL = (2, 4)

#: Recomputation choices: per stage where it fits only so (or lets a faster plan fit), never, or everywhere.
RECOMPUTE = ("auto", "none", "all")

#: Schedules whose memory the cost model counts with recomputation (a split backward, zb-h1, keeps the
#: rerun activations until its deferred weight pass; interleaved has its own accounting).
RECOMPUTE_SCHEDULES = ("1f1b", "gpipe")

Score = Callable[[Problem, Candidate], tuple[float, float]]
"""Scores a candidate of a problem: (iteration seconds, worst peak bytes), as the simulator predicts
them. It takes the problem because the memory advice plans the same model on other clusters."""


@dataclass
class Request:
    """What the user asked for; None leaves the choice to the planner."""

    method: str = "auto"
    """One of `METHODS`."""
    stages: int | None = None
    microbatches: int | None = None
    schedule: str | None = None
    """A registered schedule (`dapple_ir.schedules.SCHEDULES`)."""
    policy: str | None = None
    """One of `POLICIES`."""
    ilp_time_limit_s: float = 10.0
    virtual: int | None = None
    """Virtual stages per device group (interleaved); None lets an interleaved request choose."""
    recompute: str = "auto"
    """One of `RECOMPUTE`: `auto` recomputes a stage only where the plan fits only so or runs faster."""
    replication: str = "auto"
    """One of `REPLICATION`: replicated stages split each microbatch (DAPPLE), take whole ones round
    robin, or (`auto`) the planner weighs both per candidate."""


@dataclass
class Scored:
    cand: Candidate
    estimate: Estimate
    simulated_s: float | None = None
    simulated_peak: float | None = None
    note: str = ""

    @property
    def time_s(self) -> float:
        return self.simulated_s if self.simulated_s is not None else self.estimate.iteration_s


@dataclass
class Outcome:
    chosen: Scored
    considered: list[Scored] = field(default_factory=list)
    explain: list[str] = field(default_factory=list)


def validate(problem: Problem, req: Request) -> None:
    if req.method not in METHODS:
        raise PlanError(f"method must be one of {', '.join(METHODS)}, not '{req.method}'")
    if req.schedule is not None and req.schedule not in SCHEDULES:
        raise PlanError(f"schedule must be auto or one of {', '.join(SCHEDULES)}, not '{req.schedule}'")
    if req.policy is not None and req.policy not in POLICIES:
        raise PlanError(f"policy must be auto or one of {', '.join(POLICIES)}, not '{req.policy}'")
    if req.replication not in REPLICATION:
        raise PlanError(f"replication must be one of {', '.join(REPLICATION)}, not '{req.replication}'")
    if req.replication == "split" and ((req.virtual or 1) > 1 or req.schedule == "interleaved"):
        raise PlanError(
            "replication=split is not modelled with virtual stages (interleaved); ask for replication "
            "auto or round-robin, or another schedule"
        )
    if req.recompute not in RECOMPUTE:
        raise PlanError(f"recompute must be one of {', '.join(RECOMPUTE)}, not '{req.recompute}'")
    if req.recompute == "all" and (
        (req.schedule is not None and req.schedule not in RECOMPUTE_SCHEDULES) or (req.virtual or 1) > 1
    ):
        raise PlanError(
            f"recompute=all is modelled for the {' and '.join(RECOMPUTE_SCHEDULES)} schedules without virtual "
            f"stages, not schedule '{req.schedule}' with virtual={req.virtual}; ask for one of those, or recompute=auto"
        )
    if req.virtual is not None and req.virtual < 1:
        raise PlanError(f"virtual must be auto or a positive integer, not {req.virtual}")
    if req.virtual is not None and req.virtual > 1 and req.schedule not in (None, "interleaved"):
        raise PlanError(
            f"virtual={req.virtual} puts several stages on each device group, which only the interleaved "
            f"schedule runs; ask for schedule interleaved (or leave it to the planner), not '{req.schedule}'"
        )
    if req.virtual is not None and req.stages is not None and req.stages % req.virtual:
        raise PlanError(
            f"{req.stages} stages do not split into device groups of virtual={req.virtual} stages each; "
            f"ask for a multiple of {req.virtual} stages"
        )
    if req.virtual is not None and req.virtual > 1 and req.stages is not None and req.stages < 2 * req.virtual:
        raise PlanError(
            f"{req.stages} stages with virtual={req.virtual} make {req.stages // req.virtual} device group; "
            "interleaving needs at least two (it shrinks the bubble between groups, and one group has none): "
            f"ask for {2 * req.virtual} stages or more (stages counts every virtual stage)"
        )
    for what, count in (("stages", req.stages), ("microbatches", req.microbatches)):
        if count is not None and count < 1:
            raise PlanError(f"{what} must be auto or a positive integer, not {count}")
    cluster = problem.cluster
    if sum(problem.fwd_s) + sum(problem.bwd_s) <= 0:
        raise PlanError(
            "every layer has zero forward and backward time: the module has no costs to plan with "
            "(run 'annotate-cost' first, or check the profile's forward_compute_time/backward_compute_time)"
        )
    per_group = max(_virtual_choices(problem, req), default=1)
    if req.stages is not None and req.stages > cluster.num_devices * per_group:
        raise PlanError(
            f"{req.stages} stages were requested but cluster {cluster.name} has only {cluster.num_devices} devices "
            + (
                f"(each device group holds at most {per_group} virtual stages)"
                if per_group > 1
                else "(each stage needs at least one; interleaved virtual stages may share them)"
            )
        )
    if req.stages is not None and req.stages > problem.layers:
        raise PlanError(
            f"{req.stages} stages were requested but the model has only {problem.layers} layers after coarsen"
        )
    if req.microbatches is not None and (req.microbatches < 1 or problem.global_batch % req.microbatches):
        raise PlanError(
            f"global batch {problem.global_batch} is not divisible into {req.microbatches} microbatches; "
            f"choose a divisor of {problem.global_batch}"
        )


def search(problem: Problem, req: Request, score: Score | None = None, *, advise: bool = True) -> Outcome:
    """The best fitting plan for `problem`, with the candidates that lost and why.

    With `score`, the best few candidates by the cost model (and every baseline) are scored and ranked
    by it; without, the cost model alone ranks them. A schedule the cost model has no formula for (one
    a plugin registers) is estimated like 1f1b, and only the score tells it apart. When nothing fits,
    the PlanError carries the memory advice (`memory_advice`) unless `advise` is false.
    """
    validate(problem, req)
    schedule = req.schedule or "1f1b"
    virtuals = _virtual_choices(problem, req)
    if not virtuals:
        pool = _gather(problem, req, schedule)
    else:
        # Device groups as the 1f1b search finds them, each cut into V stages per group.
        schedule = "1f1b"
        pool = []
        bases: dict[int | None, list[Scored]] = {}
        for v in virtuals:
            groups = req.stages // v if req.stages else None
            if groups not in bases:
                base_req = dataclasses.replace(req, schedule="1f1b", stages=groups)
                bases[groups] = _gather(problem, base_req, "1f1b") + _even_groups(problem, base_req)
            pool += _interleaved(problem, bases[groups], v)
    if not virtuals:
        pool = _with_replication(problem, req, pool)
    if not virtuals and req.recompute != "none" and schedule in RECOMPUTE_SCHEDULES:
        pool = _with_recompute(problem, req, schedule, pool)
    pool = _unique(pool)
    fitting = sorted((s for s in pool if s.estimate.fits), key=lambda s: s.estimate.iteration_s)
    if not fitting:
        raise PlanError(no_fit_message(problem, pool, req, score if advise else None, advise=advise))
    # The best few by the model, and every baseline, so that the plan shown is never slower in the
    # simulator than a rule a user could apply by hand.
    head = [s for k, s in enumerate(fitting) if k < SIMULATED or s.cand.source.startswith("baseline:")]
    if req.replication == "auto":
        # The best round robin too: the model can favour split plans the simulator finds slower.
        head += [s for s in fitting if not any(s.cand.split) and s not in head][:2]
    tail = [s for s in fitting if s not in head]
    if score is not None and req.schedule is None:
        head += _schedule_variants(problem, fitting[:2], interleave=req.stages is None and req.virtual != 1)
    if score is not None:
        _score_best(problem, head, score)
    cap = problem.capacity(0)
    for s in head:
        if s.simulated_peak is not None and s.simulated_peak > cap:
            s.note = f"simulated peak {s.simulated_peak / 1e9:.1f} GB exceeds {cap / 1e9:.1f} GB"
    over = [s for s in head if s.note.startswith("simulated peak")]
    # Simulated times first (the number the user is shown), then the unsimulated by the model.
    timed = sorted((s for s in head if s not in over and s.simulated_s is not None), key=lambda s: s.time_s)
    untimed = sorted((s for s in head if s not in over and s.simulated_s is None), key=lambda s: s.time_s)
    if score is not None and timed and _cluster_is_small(problem):
        near = _local_search(problem, req, timed, pool + head, score, cap)
        head += near
        timed = sorted(timed + near, key=lambda s: s.time_s)
    if score is not None and over and not timed and not untimed:
        # Every simulated candidate overflows once lowered (the cost model counts less than a rank
        # program holds): simulate more until one fits, so that `verify` accepts the plan chosen.
        timed, more_over = _first_accepted(problem, _leanest(problem, req, schedule), tail, score, cap)
        tail = [s for s in tail if s not in timed and s not in more_over]
        over += more_over
    ranked = timed + untimed + tail
    if not ranked:
        raise PlanError(no_fit_message(problem, pool, req, score if advise else None, advise=advise))
    ranked += over
    chosen = ranked[0]
    rejected = [s for s in pool if not s.estimate.fits]
    return Outcome(chosen, ranked + rejected, explain_lines(problem, chosen, ranked, rejected))


def _gather(problem: Problem, req: Request, schedule: str) -> list[Scored]:
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
            req.replication, [True, False][: 1 + _cluster_is_small(problem)]
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
        pool += _leanest(problem, req, schedule)
    return pool


def _with_replication(problem: Problem, req: Request, pool: list[Scored]) -> list[Scored]:
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


def round_robin_priced(cand: Candidate) -> bool:
    """Whether the cost model prices `cand`'s round robin: no two neighbouring stages of different
    replica counts above one where either takes whole microbatches in turn. Such a pair waits on
    itself in the lowered order far beyond the formula (the 1.5B GPT on 2x8 V100, 128 microbatches:
    2,2,4,4,4 round robin estimates 16.7 s and simulates 33 s; split, 16.4 s and 16.8 s); equal
    counts, and a stage of one replica, pair microbatch to replica and the model holds."""
    for k in range(len(cand.stages) - 1):
        a, b = cand.stages[k].replicas, cand.stages[k + 1].replicas
        if a != b and a > 1 and b > 1 and not (cand.splits(k) and cand.splits(k + 1)):
            return False
    return True


def _with_recompute(problem: Problem, req: Request, schedule: str, pool: list[Scored]) -> list[Scored]:
    """The pool with recomputation: `all` turns it on in every stage of every candidate; `auto` adds
    the DP's plans where every stage may recompute (each trimmed to the stages that need it,
    `trim_recompute`) and, for every candidate that does not fit, the same plan recomputing the stages
    that do not fit without. The DP in recompute mode runs only when nothing fits without
    recomputation: run always (pruned by the best plan's time), it found no faster plan on any shipped
    profile on 1x8xV100 and cost up to 45% more search time (GNMT-16 on 2x8xV100)."""
    if req.recompute == "all":
        everywhere = [dataclasses.replace(s.cand, recompute=(True,) * len(s.cand.stages)) for s in pool]
        pool = [Scored(c, evaluate(problem, c)) for c in everywhere]
        return pool + _recompute_gather(problem, req, schedule, trim=False)
    extra = []
    for s in pool:
        if not s.estimate.fits and s.cand.virtual == 1:
            trimmed = trim_recompute(problem, s.cand, everywhere=True)
            if trimmed is not None:
                extra.append(trimmed)
    if not any(s.estimate.fits for s in pool):
        extra += _recompute_gather(problem, req, schedule, trim=True)
    return pool + extra


def _recompute_gather(problem: Problem, req: Request, schedule: str, *, trim: bool) -> list[Scored]:
    """The DP's candidates with every stage allowed to recompute (`dp.solve(recompute=True)`) and the
    even pipelines (`_even_groups`: P time-balanced stages of N / P replicas each) recomputing, trimmed to
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
    for even in _even_groups(problem, req):
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


def _virtual_choices(problem: Problem, req: Request) -> list[int]:
    """The virtual stage counts to plan with: the one asked for, else for an interleaved request
    2 to `MAX_VIRTUAL` (dividing the stage count when it is forced); empty without virtual stages."""
    if req.virtual is not None:
        return [req.virtual] if req.virtual > 1 else []
    if req.schedule != "interleaved":
        return []
    return [v for v in range(2, MAX_VIRTUAL + 1) if (req.stages or v) % v == 0 and v <= problem.layers]


def _even_groups(problem: Problem, req: Request) -> list[Scored]:
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


def _interleaved(problem: Problem, bases: list[Scored], *virtuals: int) -> list[Scored]:
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


def _schedule_variants(problem: Problem, best: list[Scored], *, interleave: bool = True) -> list[Scored]:
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
            variants += [v for v in _interleaved(problem, [s], *AUTO_VIRTUAL) if v.estimate.fits]
        for schedule in ("zb-h1", "gpipe"):
            if any(s.cand.recompute) and schedule not in RECOMPUTE_SCHEDULES:
                continue
            cand = dataclasses.replace(s.cand, schedule=schedule, source=f"{s.cand.source}+{schedule}")
            estimate = evaluate(problem, cand)
            if estimate.fits:
                variants.append(Scored(cand, estimate))
    return variants


def _cluster_is_small(problem: Problem) -> bool:
    """Whether simulating a plan is cheap enough for the local search (`LOCAL_DEVICES`)."""
    return problem.cluster.num_devices <= LOCAL_DEVICES


def _local_search(
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
    seen = {_plan_key(s.cand) for s in known}
    found: list[Scored] = []
    starts = timed[:LOCAL_WIDTH]
    for basin in (lambda s: not any(s.cand.split), lambda s: s.cand.source.startswith("baseline:")):
        starts += [s for s in timed if basin(s) and s not in starts][:1]
    for start in starts:
        here = start
        for _ in range(LOCAL_ROUNDS):
            near = _neighbours(problem, req, here.cand, seen)
            _score_best(problem, near, score)
            near = [n for n in near if n.simulated_s is not None and (n.simulated_peak or 0.0) <= cap]
            found += near
            better = min(near, key=lambda n: n.time_s, default=None)
            if better is None or better.time_s >= here.time_s:
                break
            here = better
    return found


def _plan_key(cand: Candidate) -> tuple:
    """What makes two candidates the same plan (the proposer aside)."""
    # A stage of one replica splits nothing: (False,) * S, () and a flag on it are the same plan.
    split = tuple(cand.splits(k) for k in range(len(cand.stages)))
    return (cand.stages, cand.microbatches, cand.schedule, cand.recompute, cand.virtual, split if any(split) else ())


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
        key = _plan_key(option)
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


def _unique(pool: list[Scored]) -> list[Scored]:
    """One entry per plan; each baseline keeps its own even when another proposes the same plan (the
    explain table lists every rule; the twin is simulated once, `_score_best`)."""
    seen: dict[tuple, Scored] = {}
    for s in pool:
        rule = s.cand.source if s.cand.source.startswith("baseline:") else ""
        key = (*_plan_key(s.cand), rule)
        if key not in seen:
            seen[key] = s
    return list(seen.values())


def write_stages(module: Module, problem: Problem, cand: Candidate) -> None:
    """Stages of `cand` into `module` (ops of their layers, in module order) and the plan's attributes."""
    position = {op: i for i, op in enumerate(module.ops)}
    module.stages = []
    for k, st in enumerate(cand.stages):
        ops = sorted((op for layer in module.layers[st.lo : st.hi] for op in layer.ops), key=position.__getitem__)
        recompute = True if cand.recomputes(k) else None
        split = True if cand.splits(k) else None
        placed = StageAttrs(replicas=st.replicas, devices=st.devices, split=split, recompute=recompute)
        module.stages.append(Stage(f"s{k}", ops, placed))
    module.programs = []
    attrs = module.attrs
    attrs.global_batch = problem.global_batch
    attrs.microbatches = cand.microbatches
    attrs.microbatch_size = problem.microbatch_size(cand.microbatches)
    attrs.schedule = cand.schedule
    attrs.cluster = problem.cluster.name or attrs.cluster


def _score_best(problem: Problem, best: list[Scored], score: Score) -> None:
    done: list[tuple[Candidate, Scored]] = []
    for s in best:
        twin = next((t for c, t in done if _lowers_alike(c, s.cand)), None)
        if twin is not None:
            # The same programs on the same devices: the simulation would repeat the twin's numbers.
            s.simulated_s, s.simulated_peak, s.note = twin.simulated_s, twin.simulated_peak, twin.note
            continue
        try:
            s.simulated_s, s.simulated_peak = score(problem, s.cand)
        except (ImportError, DappleError) as exc:
            s.note = f"not simulated: {str(exc).splitlines()[0][:120]}"
        done.append((s.cand, s))


def _lowers_alike(a: Candidate, b: Candidate) -> bool:
    """Whether `a` and `b` lower to the same rank programs up to renumbering the ranks, so that
    their simulations agree: the same stages and microbatches, and either schedules that order
    every replica's work the same way, or one stage whose replicas get equal shares of the
    microbatches on the same set of devices (the order of the devices then only renames ranks)."""
    if (
        a.microbatches != b.microbatches
        or len(a.stages) != len(b.stages)
        or a.virtual != b.virtual
        or a.recompute != b.recompute
        or a.split != b.split
    ):
        return False
    if a.stages != b.stages:
        if len(a.stages) != 1 or a.microbatches % a.stages[0].replicas:
            return False
        x, y = a.stages[0], b.stages[0]
        if (x.lo, x.hi, x.replicas) != (y.lo, y.hi, y.replicas) or set(x.devices) != set(y.devices):
            return False
        if a.schedule == b.schedule:
            return True
    elif a.schedule == b.schedule:
        return True
    # Only the schedule differs: compare the work each replica runs (no pass after `schedule` reads
    # the schedule's name, only the orders it produced).
    if "interleaved" in (a.schedule, b.schedule):
        return False
    request = ScheduleRequest(replicas=a.replicas, microbatches=a.microbatches)
    return build_schedule(a.schedule, request) == build_schedule(b.schedule, request)


def _leanest(problem: Problem, req: Request, schedule: str) -> list[Scored]:
    """When nothing else fits: for each microbatch count, the candidate that fits on the fewest
    devices counting what its rank programs receive too (`memory_fit.leanest_plan`), and copies of
    it over the devices left (more replicas hold fewer microbatches each)."""
    g, n = problem.global_batch, problem.cluster.num_devices
    found = []
    for m in [req.microbatches] if req.microbatches else _divisors(g):
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


def _first_accepted(
    problem: Problem, lean: list[Scored], tail: list[Scored], score: Score, cap: float
) -> tuple[list[Scored], list[Scored]]:
    """([the first candidate whose simulated peak fits], [those simulated that did not]): the
    memory-first ones (built to fit once lowered), then the rest, each by the model's time;
    at most 2 x SIMULATED simulations."""
    rejected: list[Scored] = []
    order = sorted((c for c in lean if c.estimate.fits), key=lambda c: c.estimate.iteration_s) + tail
    for s in order[: 2 * SIMULATED]:
        _score_best(problem, [s], score)
        if s.simulated_peak is None or s.simulated_peak <= cap:
            return [s], rejected
        s.note = f"simulated peak {s.simulated_peak / 1e9:.1f} GB exceeds {cap / 1e9:.1f} GB"
        rejected.append(s)
    return [], rejected


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def no_fit_message(
    problem: Problem, pool: list[Scored], req: Request, score: Score | None = None, *, advise: bool = True
) -> str:
    """Why nothing fits on this cluster, and (with `advise`) the memory advice."""
    cluster = problem.cluster
    cap = problem.capacity(0)
    least = min((s.estimate.peak_bytes for s in pool), default=math.inf)
    text = (
        f"no plan fits in memory on {cluster.name} ({cluster.num_devices} x {cap / GB:.1f} GB) for global batch "
        f"{problem.global_batch}: parameters, gradients and optimizer state take {problem.ps[-1] / GB:.1f} GB in all"
        + (f", and the leanest candidate still needs {least / GB:.1f} GB on one device" if least < math.inf else "")
    )
    if not advise:
        return text + "."
    return text + ". " + memory_advice(problem, req, score).text


#: The largest cluster the memory advice considers, in devices.
ADVICE_MAX_DEVICES = 4096

#: At most this many clusters (besides the given one) are planned to confirm an advice.
ADVICE_MAX_CLUSTERS = 8


@dataclass(frozen=True)
class MemoryAdvice:
    """The one answer to "what makes it fit": the smallest cluster of the same device kind and node
    shape on which the planner finds a plan (this one, when only the microbatch count must change),
    with the microbatch count to ask for. Every cluster and count it names was planned by `search`
    with the same request and score, so following it gives a plan; every smaller cluster either
    cannot fit by the memory model (`memory_fit.leanest_plan`) or was planned and found no plan."""

    text: str
    """The advice as the error message gives it."""
    cluster: str | None = None
    """The cluster that fits (this one or the smallest that does); None when none does."""
    microbatches: int | None = None
    """`--microbatches` to ask for; None when the request's own (or the planner's choice) fits."""
    least_devices: int | None = None
    """Fewest devices on which any candidate fits by the memory model; None when none at any size."""
    tried: tuple[str, ...] = ()
    """Clusters the planner ran on and found no plan, smallest first."""
    recompute: str | None = None
    """The flag that makes the model fit on the given cluster by recomputing (a stage then keeps only
    its inputs per microbatch in flight), when the request ruled recomputation out and planning with
    `recompute=auto` finds a plan; it comes before the answers that change the cluster or the
    microbatch count."""


def memory_advice(problem: Problem, req: Request, score: Score | None = None) -> MemoryAdvice:
    """What makes `problem` fit, computed by one rule (see `MemoryAdvice`).

    In order: when no plan fits on any number of devices, the layer that needs the most memory even
    alone with one sample; else, when the request forces a microbatch count, this cluster with the
    fewest other count that plans; else the fewest nodes, from the memory model's lower bound up to
    `ADVICE_MAX_DEVICES` devices (at most `ADVICE_MAX_CLUSTERS` planned), on which the planner finds
    a plan with the request as given (or, when it forces a count, with the fewest other count that
    plans). A request that leaves the count to the planner needs no other: when nothing else fits,
    `search` tries the leanest candidate of every count. Only counts the memory model allows on a
    cluster are planned there.
    """
    cluster, g = problem.cluster, problem.global_batch
    kind, cap = cluster.device(0).name, problem.capacity(0)
    schedule = req.schedule or "1f1b"
    rerun = req.recompute != "none" and schedule in RECOMPUTE_SCHEDULES and (req.virtual or 1) == 1
    needs = {
        m: lean.devices
        for m in _divisors(g)
        if (lean := leanest_plan(problem, m, schedule, req.stages, recompute=rerun))
    }
    if req.recompute == "none" and _plans(problem, dataclasses.replace(req, recompute="auto"), score):
        return MemoryAdvice(
            f"It fits on {cluster.name} with --recompute auto (stages that do not fit recompute their forward).",
            cluster.name,
            recompute="auto",
        )
    if not needs:
        return MemoryAdvice(_no_cluster_text(problem, req))
    least = min(needs.values())
    each = f"{kind} devices ({cap / GB:.1f} GB each)"

    def first_that_plans(trial: Problem, *, as_given: bool) -> Request | None:
        fits = [m for m in sorted(needs) if needs[m] <= trial.cluster.num_devices and m != req.microbatches]
        counts = fits if req.microbatches is not None else []
        asks = ([req] if as_given else []) + [dataclasses.replace(req, microbatches=m) for m in counts]
        return next((ask for ask in asks if _plans(trial, ask, score)), None)

    if req.microbatches is not None and least <= cluster.num_devices:
        here = first_that_plans(problem, as_given=False)  # as given, it just failed
        if here is not None and here.microbatches is not None:
            m = here.microbatches
            return MemoryAdvice(
                f"It fits on {cluster.name} with --microbatches {m} (microbatch size {g // m}).", cluster.name, m, least
            )
    per, tried = cluster.devices_per_node, list[str]()
    last = ADVICE_MAX_DEVICES // per
    for nodes in range(max(1, -(-least // per)), last + 1):
        if nodes == cluster.nodes:
            continue
        if len(tried) == ADVICE_MAX_CLUSTERS:
            last = nodes - 1
            break
        name, bigger = _resized(cluster, nodes)
        ask = first_that_plans(dataclasses.replace(problem, cluster=bigger), as_given=True)
        if ask is None:
            tried.append(name)
            continue
        count = ask.microbatches if ask.microbatches != req.microbatches else None
        flags = (f"--cluster {name}" if _is_shorthand(cluster) else "") + (f" --microbatches {count}" if count else "")
        return MemoryAdvice(
            f"The smallest cluster of {per}-device nodes that fits is {name}"
            + (f" ({flags.strip()})" if flags else "")
            + f": by the memory model no plan fits on fewer than {least} {each}"
            + (f", and the planner finds none on {', '.join(tried)}" if tried else "")
            + ".",
            name,
            count,
            least,
            tuple(tried),
        )
    return MemoryAdvice(
        f"No cluster of {per}-device nodes up to {_resized(cluster, last)[0]} fits it: by the memory model no plan "
        f"fits on fewer than {least} {each}"
        + (f", and the planner finds none on {', '.join(tried)}" if tried else "")
        + "; use devices with more memory.",
        None,
        None,
        least,
        tuple(tried),
    )


def _plans(problem: Problem, req: Request, score: Score | None) -> bool:
    try:
        search(problem, req, score, advise=False)
    except PlanError:
        return False
    return True


def _is_shorthand(cluster: ClusterSpec) -> bool:
    per, kind = cluster.devices_per_node, cluster.device(0).name
    return cluster.name in (f"{cluster.nodes}x{per}x{kind}", f"{per}x{kind}" if cluster.nodes == 1 else "")


def _resized(cluster: ClusterSpec, nodes: int) -> tuple[str, ClusterSpec]:
    """`cluster` with `nodes` nodes, and its name: a shorthand when `cluster` came from one (so that
    the advice is planned on exactly what `--cluster NAME` builds), else a description."""
    if _is_shorthand(cluster):
        shape = f"{nodes}x{cluster.devices_per_node}x{cluster.device(0).name}"
        return shape, parse_shorthand(shape)
    name = f"{cluster.name or 'this cluster'} with nodes = {nodes}"
    return name, dataclasses.replace(cluster, node_kinds=(cluster.node_kinds[0],) * nodes, name=name)


def _no_cluster_text(problem: Problem, req: Request) -> str:
    kind, cap = problem.cluster.device(0).name, problem.capacity(0)
    if req.stages is not None:
        return (
            f"No plan of {req.stages} stages fits on any number of {kind} devices ({cap / GB:.1f} GB each); "
            "leave --stages to the planner, or use devices with more memory."
        )
    worst = tightest_layer(problem)
    return (
        f"No cluster of {kind} devices fits it: layer {worst.name} alone needs {worst.static_bytes / GB:.1f} GB "
        f"of parameters, gradients and optimizer state and {worst.activation_bytes / GB:.1f} GB of activations "
        f"for one sample, more than one {kind} holds ({cap / GB:.1f} GB); use devices with more memory."
    )


def explain_lines(problem: Problem, chosen: Scored, ranked: list[Scored], rejected: list[Scored]) -> list[str]:
    gb = GB
    lines = [
        f"plan: {problem.layers} layers, global batch {problem.global_batch}, cluster {problem.cluster.name} "
        f"({problem.cluster.num_devices} devices); {len(ranked)} fitting candidates, {len(rejected)} rejected",
        f"{'#':>3}  {'source':<34} {'S':>3} {'replicas':<18} {'P':>3} {'policy':<13} {'M':>4} {'schedule':<8} "
        f"{'model ms':>10} {'sim ms':>10} {'peak GB':>8} {'recompute':<12} {'busiest link':<16} {'%':>3}  verdict",
    ]
    cluster = problem.cluster
    if cluster.shares_cores:
        lines.insert(
            1,
            f"each node's {cluster.devices_per_node} ranks share {cluster.cores_per_node} core(s): they take turns "
            "(simulated), and no plan is faster than its busiest node's work over its cores (the model's core "
            f"floor; the chosen plan's: {chosen.estimate.cores_s * 1e3:.3f} ms)",
        )
    # The best dozen, and every baseline as proposed (a user compares against those first).
    baselines = [s for s in ranked[12:] if s.cand.source.startswith("baseline:") and "~" not in s.cand.source]
    for k, s in enumerate([*ranked[:12], *baselines, *rejected[:8]], start=1):
        c, e = s.cand, s.estimate
        reps = c.replication()
        reps = reps if len(reps) <= 18 else reps[:15] + "..."
        # The link the plan loads most (bytes per iteration over its bandwidth), and that time's share
        # of the model's iteration: 100 % means the link alone sets the pace.
        link = e.busiest_link or "-"
        share = (
            f"{min(999, round(100 * e.busiest_s / e.iteration_s)):>3}"
            if e.busiest_link and e.iteration_s > 0
            else "  -"
        )
        sim = f"{s.simulated_s * 1e3:10.3f}" if s.simulated_s is not None else f"{'-':>10}"
        rc = c.recomputing()
        rc = rc if len(rc) <= 12 else rc[:9] + "..."
        schedule = f"{c.schedule}/v{c.virtual}" if c.virtual > 1 else c.schedule
        source = c.source if len(c.source) <= 34 else c.source[:31] + "..."
        if s is chosen:
            verdict = "CHOSEN"
        elif s.note.startswith("simulated peak"):
            verdict = f"rejected: {s.note}"
        elif not e.fits:
            worst = max(range(len(e.stage_peak_bytes)), key=lambda i: e.stage_peak_bytes[i] - e.stage_capacity[i])
            verdict = (
                f"rejected: stage {worst} needs {e.stage_peak_bytes[worst] / gb:.1f} GB > "
                f"{e.stage_capacity[worst] / gb:.1f} GB"
            )
        elif s.simulated_s is None and chosen.simulated_s is not None:
            verdict = f"lost: not among the best by the model ({e.iteration_s / chosen.estimate.iteration_s:.2f}x)"
        else:
            verdict = f"lost: {s.time_s / chosen.time_s:.2f}x the chosen time"
            if s.note:
                verdict += f" ({s.note})"
        lines.append(
            f"{k:>3}  {source:<34} {len(c.stages):>3} {reps:<18} {c.pipelines:>3} {c.policy:<13} "
            f"{c.microbatches:>4} {schedule:<8} {e.iteration_s * 1e3:10.3f} {sim} {e.peak_bytes / gb:8.2f} "
            f"{rc:<12} {link:<16} {share}  {verdict}"
        )
    cuts = ", ".join(
        f"s{k}: layers {st.lo}-{st.hi - 1} on {list(st.devices)}{' split' if chosen.cand.splits(k) else ''}"
        f"{' recomputing' if chosen.cand.recomputes(k) else ''}"
        for k, st in enumerate(chosen.cand.stages)
    )
    lines.append(f"chosen: {cuts}")
    return lines
