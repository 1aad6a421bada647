"""Sharded optimizer state (ZeRO-1) choices: twins of replicated candidates whose replicated stages shard it.

Sharding moves the same bytes over the links as the allreduce it replaces (a reduce-scatter, then an
all-gather after the step) and steps 1/R of the stage's parameters, keeping 1/R of their optimizer state, so
a twin is never slower by the model and always leaner; `auto` keeps a twin where it is faster or fits when its
original does not, `all` shards every replicated stage, `none` none. The DP and the ILP do not see the choice
(as with replication, it is a twin pass over their plans): every twin is priced by `cost_model.evaluate`.
"""

from __future__ import annotations

import dataclasses

from dapple_ir.planner.cost_model import Problem, evaluate
from dapple_ir.planner.request import Request
from dapple_ir.planner.scoring import Scored


def zero_variants(problem: Problem, req: Request, pool: list[Scored]) -> list[Scored]:
    """The pool with sharded optimizer state as `req.zero` asks (see the module docstring)."""
    if req.zero == "none":
        return pool
    out: list[Scored] = [] if req.zero == "all" else list(pool)
    for s in pool:
        replicated = tuple(st.replicas > 1 for st in s.cand.stages)
        if not any(replicated):
            if req.zero == "all":
                out.append(s)
            continue
        twin_cand = dataclasses.replace(s.cand, zero=replicated)
        twin = Scored(twin_cand, evaluate(problem, twin_cand))
        faster = twin.estimate.iteration_s < s.estimate.iteration_s
        if req.zero == "all" or faster or (twin.estimate.fits and not s.estimate.fits):
            out.append(twin)
    return out
