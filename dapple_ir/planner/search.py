"""The planner's search: gather candidates (DP, ILP, baselines), check them, rank the best few by a
score the caller gives (the `plan` pass lowers and simulates them), and explain the choice. The
`plan` pass is a thin shell around `search`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from dapple_ir.errors import DappleError, PlanError
from dapple_ir.ir import Module, Stage, StageAttrs
from dapple_ir.planner.baselines import all_baselines
from dapple_ir.planner.cost_model import POLICIES, Candidate, Estimate, Problem, evaluate, microbatch_choices
from dapple_ir.planner.dp import plan_dp, policies_for, replicated_pipelines
from dapple_ir.planner.ilp import plan_ilp
from dapple_ir.schedules import SCHEDULES, ScheduleRequest, build_schedule
from dapple_ir.units import GB

#: The search methods: the DP, the CP-SAT model, or both (`auto`, the best few ranked by the score).
METHODS = ("auto", "dp", "ilp")

#: How many of the best candidates `auto` lowers and simulates.
SIMULATED = 4

Score = Callable[[Candidate], tuple[float, float]]
"""Scores a candidate: (iteration seconds, worst peak bytes), as the simulator predicts them."""


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
    for what, count in (("stages", req.stages), ("microbatches", req.microbatches)):
        if count is not None and count < 1:
            raise PlanError(f"{what} must be auto or a positive integer, not {count}")
    cluster = problem.cluster
    if sum(problem.fwd_s) + sum(problem.bwd_s) <= 0:
        raise PlanError(
            "every layer has zero forward and backward time: the module has no costs to plan with "
            "(run 'annotate-cost' first, or check the profile's forward_compute_time/backward_compute_time)"
        )
    if req.stages is not None and req.stages > cluster.num_devices:
        raise PlanError(
            f"{req.stages} stages were requested but cluster {cluster.name} has only {cluster.num_devices} devices "
            "(each stage needs at least one)"
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


def search(problem: Problem, req: Request, score: Score | None = None) -> Outcome:
    """The best fitting plan for `problem`, with the candidates that lost and why.

    With `score`, the best few candidates by the cost model (and every baseline) are scored and ranked
    by it; without, the cost model alone ranks them. A schedule the cost model has no formula for (one
    a plugin registers) is estimated like 1f1b, and only the score tells it apart.
    """
    validate(problem, req)
    cluster = problem.cluster
    ms = [req.microbatches] if req.microbatches else microbatch_choices(problem.global_batch, cluster.num_devices)
    schedule = req.schedule or "1f1b"
    policies = [req.policy] if req.policy else policies_for(cluster, POLICIES)
    pool: list[Scored] = []
    if req.stages is None and req.microbatches is None and req.policy is None:
        for name, (cand, _est) in all_baselines(problem).items():
            cand = Candidate(cand.stages, cand.microbatches, schedule, cand.policy, f"baseline:{name}")
            pool.append(Scored(cand, evaluate(problem, cand)))
    bound = min((s.estimate.iteration_s for s in pool if s.estimate.fits), default=math.inf)
    if req.method in ("dp", "auto"):
        # Small instances get uncapped Pareto fronts: the DP is then exact for the cost model.
        front = None if problem.layers * cluster.num_devices <= 128 else 3
        for cand, est in plan_dp(
            problem,
            microbatches=ms,
            schedules=[schedule],
            policies=policies,
            stages=req.stages,
            bound=bound * 1.25,
            front=front,
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
    pool = _unique(pool)
    fitting = sorted((s for s in pool if s.estimate.fits), key=lambda s: s.estimate.iteration_s)
    if not fitting:
        raise PlanError(no_fit_message(problem, pool, req))
    # The best few by the model, and every baseline, so that the plan shown is never slower in the
    # simulator than a rule a user could apply by hand.
    head = [s for k, s in enumerate(fitting) if k < SIMULATED or s.cand.source.startswith("baseline:")]
    tail = [s for s in fitting if s not in head]
    if score is not None and req.schedule is None:
        head += _schedule_variants(problem, fitting[:2])
    if score is not None:
        _score_best(head, score)
    cap = problem.capacity(0)
    for s in head:
        if s.simulated_peak is not None and s.simulated_peak > cap:
            s.note = f"simulated peak {s.simulated_peak / 1e9:.1f} GB exceeds {cap / 1e9:.1f} GB"
    over = [s for s in head if s.note.startswith("simulated peak")]
    # Simulated times first (the number the user is shown), then the unsimulated by the model.
    timed = sorted((s for s in head if s not in over and s.simulated_s is not None), key=lambda s: s.time_s)
    untimed = sorted((s for s in head if s not in over and s.simulated_s is None), key=lambda s: s.time_s)
    ranked = timed + untimed + tail
    if not ranked:
        raise PlanError(no_fit_message(problem, pool, req))
    ranked += over
    chosen = ranked[0]
    rejected = [s for s in pool if not s.estimate.fits]
    return Outcome(chosen, ranked + rejected, explain_lines(problem, chosen, ranked, rejected))


def _schedule_variants(problem: Problem, best: list[Scored]) -> list[Scored]:
    """The best 1f1b plans again under zb-h1 (weight gradients fill bubbles) and gpipe (no early
    backward: fewer waits between unevenly replicated stages, more memory), where they fit; the
    simulator tells which order of the same work runs fastest."""
    variants = []
    for s in best:
        if s.cand.schedule != "1f1b":
            continue
        for schedule in ("zb-h1", "gpipe"):
            cand = dataclasses.replace(s.cand, schedule=schedule, source=f"{s.cand.source}+{schedule}")
            estimate = evaluate(problem, cand)
            if estimate.fits:
                variants.append(Scored(cand, estimate))
    return variants


def _unique(pool: list[Scored]) -> list[Scored]:
    seen: dict[tuple, Scored] = {}
    for s in pool:
        key = (s.cand.stages, s.cand.microbatches, s.cand.schedule)
        if key not in seen:
            seen[key] = s
    return list(seen.values())


def write_stages(module: Module, problem: Problem, cand: Candidate) -> None:
    """Stages of `cand` into `module` (ops of their layers, in module order) and the plan's attributes."""
    position = {op: i for i, op in enumerate(module.ops)}
    module.stages = []
    for k, st in enumerate(cand.stages):
        ops = sorted((op for layer in module.layers[st.lo : st.hi] for op in layer.ops), key=position.__getitem__)
        module.stages.append(Stage(f"s{k}", ops, StageAttrs(replicas=st.replicas, devices=st.devices)))
    module.programs = []
    attrs = module.attrs
    attrs.global_batch = problem.global_batch
    attrs.microbatches = cand.microbatches
    attrs.microbatch_size = problem.microbatch_size(cand.microbatches)
    attrs.schedule = cand.schedule
    attrs.cluster = problem.cluster.name or attrs.cluster


def _score_best(best: list[Scored], score: Score) -> None:
    done: list[tuple[Candidate, Scored]] = []
    for s in best:
        twin = next((t for c, t in done if _lowers_alike(c, s.cand)), None)
        if twin is not None:
            # The same programs on the same devices: the simulation would repeat the twin's numbers.
            s.simulated_s, s.simulated_peak, s.note = twin.simulated_s, twin.simulated_peak, twin.note
            continue
        try:
            s.simulated_s, s.simulated_peak = score(s.cand)
        except (ImportError, DappleError) as exc:
            s.note = f"not simulated: {str(exc).splitlines()[0][:120]}"
        done.append((s.cand, s))


def _lowers_alike(a: Candidate, b: Candidate) -> bool:
    """Whether `a` and `b` lower to the same rank programs up to renumbering the ranks, so that
    their simulations agree: the same stages and microbatches, and either schedules that order
    every replica's work the same way, or one stage whose replicas get equal shares of the
    microbatches on the same set of devices (the order of the devices then only renames ranks)."""
    if a.microbatches != b.microbatches or len(a.stages) != len(b.stages):
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


def no_fit_message(problem: Problem, pool: list[Scored], req: Request) -> str:
    cluster = problem.cluster
    cap = problem.capacity(0)
    kind = cluster.device(0).name
    gb = GB
    biggest = max(problem.static_bytes)
    if biggest > cap:
        return (
            f"no plan fits in memory on {cluster.name}: layer {problem.names[problem.static_bytes.index(biggest)]} "
            "alone "
            f"needs {biggest / gb:.1f} GB of parameters, gradients and optimizer state, more than one {kind} "
            f"holds ({cap / gb:.1f} GB); use devices with more memory"
        )
    least = min((s.estimate.peak_bytes for s in pool), default=math.inf)
    text = (
        f"no plan fits in memory on {cluster.name} ({cluster.num_devices} x {cap / gb:.1f} GB) for global batch "
        f"{problem.global_batch}: parameters, gradients and optimizer state take {problem.ps[-1] / gb:.1f} GB in all"
        + (f", and the leanest candidate still needs {least / gb:.1f} GB on one device" if least < math.inf else "")
    )
    return text + ". " + _fit_hint(problem, req)


def _fits_somehow(problem: Problem, microbatches: list[int], stages: int | None) -> bool:
    found = plan_dp(
        problem, microbatches=microbatches, schedules=["1f1b"], policies=["append-first"], stages=stages, front=1
    )
    return any(est.fits for _cand, est in found)


def _fit_hint(problem: Problem, req: Request) -> str:
    """The largest microbatch count, else the smallest cluster of this node shape, that would fit."""
    g, cluster = problem.global_batch, problem.cluster
    if req.microbatches != g and _fits_somehow(problem, [g], req.stages):
        return f"It fits with --microbatches {g} (microbatch size 1)."
    per, kind = cluster.devices_per_node, cluster.device(0).name
    start = max(cluster.nodes + 1, math.ceil(problem.ps[-1] / problem.capacity(0) / per))
    nodes = start
    while nodes * per <= 4096:
        bigger = dataclasses.replace(cluster, node_kinds=(cluster.node_kinds[0],) * nodes, name=f"{nodes}x{per}x{kind}")
        trial = dataclasses.replace(problem, cluster=bigger)
        if _fits_somehow(trial, microbatch_choices(g, bigger.num_devices), req.stages):
            shape = f"{nodes}x{per}x{kind}"
            return f"The smallest cluster of {per}-device nodes that fits is {shape} (--cluster {shape})."
        nodes = nodes + 1 if nodes < start + 8 else int(nodes * 1.5)
    return "No cluster of up to 4096 such devices fits it; use devices with more memory."


def explain_lines(problem: Problem, chosen: Scored, ranked: list[Scored], rejected: list[Scored]) -> list[str]:
    gb = GB
    lines = [
        f"plan: {problem.layers} layers, global batch {problem.global_batch}, cluster {problem.cluster.name} "
        f"({problem.cluster.num_devices} devices); {len(ranked)} fitting candidates, {len(rejected)} rejected",
        f"{'#':>3}  {'source':<28} {'S':>3} {'replicas':<22} {'P':>3} {'policy':<13} {'M':>4} {'schedule':<8} "
        f"{'model ms':>10} {'sim ms':>10} {'peak GB':>8}  verdict",
    ]
    for k, s in enumerate([*ranked[:12], *rejected[:8]], start=1):
        c, e = s.cand, s.estimate
        reps = ",".join(str(r) for r in c.replicas)
        reps = reps if len(reps) <= 22 else reps[:19] + "..."
        sim = f"{s.simulated_s * 1e3:10.3f}" if s.simulated_s is not None else f"{'-':>10}"
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
            f"{k:>3}  {c.source:<28} {len(c.stages):>3} {reps:<22} {c.pipelines:>3} {c.policy:<13} "
            f"{c.microbatches:>4} {c.schedule:<8} {e.iteration_s * 1e3:10.3f} {sim} {e.peak_bytes / gb:8.2f}  {verdict}"
        )
    cuts = ", ".join(
        f"s{k}: layers {st.lo}-{st.hi - 1} on {list(st.devices)}" for k, st in enumerate(chosen.cand.stages)
    )
    lines.append(f"chosen: {cuts}")
    return lines
