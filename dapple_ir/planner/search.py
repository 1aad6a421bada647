"""The planner's search: gather candidates (DP, ILP, baselines), check them, rank the best few by a
score the caller gives (the `plan` pass lowers and simulates them), and explain the choice; when nothing
fits, the one memory advice. The `plan` pass is a thin shell around `search`.

Each step is a module of its own: `request` (what may be asked, `validate`), `gather` (the searches'
candidates and their variants), `recompute`, `scoring`, `local_search`, `ranking` (the whole search
without the advice), `memory_advice`, `explain` and `stages` (the chosen plan written into the IR).
The names callers use are importable from here.
"""

from __future__ import annotations

import dataclasses

from dapple_ir.errors import PlanError
from dapple_ir.planner.cost_model import Problem
from dapple_ir.planner.memory_advice import MemoryAdvice, memory_advice
from dapple_ir.planner.ranking import NoPlanFits, Outcome, rank
from dapple_ir.planner.recompute import trim_recompute
from dapple_ir.planner.request import METHODS, RECOMPUTE, Request, validate
from dapple_ir.planner.scoring import Score, Scored, lowers_alike
from dapple_ir.planner.stages import write_stages

__all__ = [
    "METHODS",
    "RECOMPUTE",
    "MemoryAdvice",
    "Outcome",
    "Request",
    "Score",
    "Scored",
    "_lowers_alike",
    "memory_advice",
    "search",
    "trim_recompute",
    "validate",
    "write_stages",
]

#: Kept under its old name for the callers that compare lowerings (tests/test_planner_shortcuts.py).
_lowers_alike = lowers_alike


def search(problem: Problem, req: Request, score: Score | None = None, *, advise: bool = True) -> Outcome:
    """The best fitting plan for `problem`, with the candidates that lost and why (`ranking.rank`).
    When nothing fits, the PlanError carries the memory advice (`memory_advice`) unless `advise` is false."""
    try:
        return rank(problem, req, score)
    except NoPlanFits as exc:
        if not advise:
            raise
        # The advice plans the model on other clusters: its searches are not this one's progress.
        advice = memory_advice(problem, dataclasses.replace(req, progress=None), score)
        raise PlanError(f"{exc} {advice.text}") from None
