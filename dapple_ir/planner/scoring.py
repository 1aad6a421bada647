"""Scoring candidates: the caller's score (the `plan` pass lowers and simulates), a candidate with its
estimate and simulation (`Scored`), what makes two candidates one plan (`plan_key`), and scoring the best
few once each (`score_best`: candidates that lower to the same rank programs share one simulation), and
which round-robin candidates the cost model prices (`round_robin_priced`), and the search's progress for
the user (`SearchProgress`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from dapple_ir.errors import DappleError
from dapple_ir.planner.cost_model import Candidate, Estimate, Problem
from dapple_ir.schedules import ScheduleRequest, build_schedule

Score = Callable[[Problem, Candidate], tuple[float, float]]
"""Scores a candidate of a problem: (iteration seconds, worst peak bytes), as the simulator predicts
them. It takes the problem because the memory advice plans the same model on other clusters."""


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
class SearchProgress:
    """The search's progress for the user, through `report` (the pass context's log): candidates gathered,
    how many were simulated and the best simulated time that fits, at most once every `interval_s` (a
    large plan simulates for a minute; a line a second shows it is moving without flooding the screen)."""

    report: Callable[[str], None]
    interval_s: float = 1.0
    gathered: int = 0
    simulated: int = 0
    best_s: float = math.inf
    last_report: float = -math.inf

    def counting(self, score: Score) -> Score:
        """`score`, counting its simulations and reporting the progress as they finish."""

        def counted(problem: Problem, cand: Candidate) -> tuple[float, float]:
            seconds, peak = score(problem, cand)
            self.simulated += 1
            if peak <= problem.capacity(0):
                self.best_s = min(self.best_s, seconds)
            self.tick()
            return seconds, peak

        return counted

    def found(self, candidates: int) -> None:
        self.gathered += candidates
        self.tick()

    def tick(self) -> None:
        now = time.monotonic()
        if now - self.last_report < self.interval_s:
            return
        self.last_report = now
        best = f", best {self.best_s:.3f} s" if self.best_s < math.inf else ""
        self.report(f"plan: {self.gathered} candidates gathered, {self.simulated} simulated{best}")


def plan_key(cand: Candidate) -> tuple:
    """What makes two candidates the same plan (the proposer aside)."""
    # A stage of one replica splits nothing: (False,) * S, () and a flag on it are the same plan.
    split = tuple(cand.splits(k) for k in range(len(cand.stages)))
    zero = tuple(cand.shards(k) for k in range(len(cand.stages)))
    return (
        cand.stages,
        cand.microbatches,
        cand.schedule,
        cand.recompute,
        cand.virtual,
        split if any(split) else (),
        zero if any(zero) else (),
    )


def unique(pool: list[Scored]) -> list[Scored]:
    """One entry per plan; each baseline keeps its own even when another proposes the same plan (the
    explain table lists every rule; the twin is simulated once, `score_best`)."""
    seen: dict[tuple, Scored] = {}
    for s in pool:
        rule = s.cand.source if s.cand.source.startswith("baseline:") else ""
        key = (*plan_key(s.cand), rule)
        if key not in seen:
            seen[key] = s
    return list(seen.values())


def score_best(problem: Problem, best: list[Scored], score: Score) -> None:
    done: list[tuple[Candidate, Scored]] = []
    for s in best:
        twin = next((t for c, t in done if lowers_alike(c, s.cand)), None)
        if twin is not None:
            # The same programs on the same devices: the simulation would repeat the twin's numbers.
            s.simulated_s, s.simulated_peak, s.note = twin.simulated_s, twin.simulated_peak, twin.note
            continue
        try:
            s.simulated_s, s.simulated_peak = score(problem, s.cand)
        except (ImportError, DappleError) as exc:
            s.note = f"not simulated: {str(exc).splitlines()[0][:120]}"
        done.append((s.cand, s))


def lowers_alike(a: Candidate, b: Candidate) -> bool:
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
        or a.zero != b.zero
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
