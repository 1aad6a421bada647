"""What a user asks the planner for (`Request`), the choices it may name, and the checks that refuse
a request no plan can satisfy before any search runs (`validate`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dapple_ir.errors import PlanError
from dapple_ir.planner.cost_model import POLICIES, REPLICATION, Problem
from dapple_ir.schedules import SCHEDULES

#: The search methods: the DP, the CP-SAT model, or both (`auto`, the best few ranked by the score).
METHODS = ("auto", "dp", "ilp")

#: The most virtual stages per device group an interleaved request without `virtual` tries.
MAX_VIRTUAL = 4

#: Recomputation choices: per stage where it fits only so (or lets a faster plan fit), never, or everywhere.
RECOMPUTE = ("auto", "none", "all")
#: Sharded optimizer state (ZeRO-1) of replicated stages: where it helps, nowhere, everywhere (`planner.zero`).
ZERO = ("auto", "none", "all")

#: Schedules whose memory the cost model counts with recomputation (a split backward, zb-h1, keeps the
#: rerun activations until its deferred weight pass; interleaved has its own accounting).
RECOMPUTE_SCHEDULES = ("1f1b", "gpipe")


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
    zero: str = "none"
    """`auto`, `none` or `all`: shard the optimizer state of replicated stages (ZeRO-1, `planner.zero`). `none` by
    default until the simulator prices reduce_scatter and all_gather (it runs them as free now), so that its
    ranking cannot favour a sharded twin for collectives it does not see."""
    tensor_parallel: int | None = None
    """Tensor-parallel degree of every stage (Megatron-LM's, `pricing.tensor`); the problem is then one member's on
    the grouped cluster. None: the caller (`plan`) searches the degrees."""
    data_parallel: int | None = None
    """Replicas of every stage (data parallelism, as Megatron-LM and torchtitan give one degree to all stages);
    None: the planner chooses per stage (DAPPLE's uneven replication)."""
    cuts: tuple[int, ...] = ()
    """Layer boundaries where a stage must begin (`--split-at`, `analysis.module_cuts.split_layers`): the
    stages are these and only these; the planner chooses replication, placement, microbatches and schedule."""
    progress: Callable[[str], None] | None = field(default=None, compare=False, repr=False)
    """Where the search reports its progress (candidates gathered and simulated, the best so far:
    `scoring.SearchProgress`); None: nowhere."""


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
    if req.zero not in ZERO:
        raise PlanError(f"zero must be one of {', '.join(ZERO)}, not '{req.zero}'")
    if req.recompute not in RECOMPUTE:
        raise PlanError(f"recompute must be one of {', '.join(RECOMPUTE)}, not '{req.recompute}'")
    if req.recompute == "all" and req.schedule not in (None, "interleaved", *RECOMPUTE_SCHEDULES):
        raise PlanError(
            f"recompute=all is modelled for the {', '.join(RECOMPUTE_SCHEDULES)} and interleaved schedules, not "
            f"schedule '{req.schedule}'; ask for one of those, or recompute=auto"
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
    _validate_cuts(problem, req)
    # Interleaved stages share their device groups: V of them per group.
    deep = (req.stages or 1) // (req.virtual or 1) or 1
    if req.data_parallel is not None and (
        req.data_parallel < 1 or req.data_parallel * deep > problem.cluster.num_devices
    ):
        groups = f" tensor groups of {problem.tp}" if problem.tp > 1 else " devices"
        raise PlanError(
            f"data-parallel {req.data_parallel} x {deep} device group(s) deep needs that many{groups}, but cluster "
            f"{problem.cluster.name} has {problem.cluster.num_devices}"
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
    per_group = max(virtual_choices(problem, req), default=1)
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


def virtual_choices(problem: Problem, req: Request) -> list[int]:
    """The virtual stage counts to plan with: the one asked for, else for an interleaved request
    2 to `MAX_VIRTUAL` (dividing the stage count when it is forced); empty without virtual stages."""
    if req.virtual is not None:
        return [req.virtual] if req.virtual > 1 else []
    if req.schedule != "interleaved":
        return []
    return [v for v in range(2, MAX_VIRTUAL + 1) if (req.stages or v) % v == 0 and v <= problem.layers]


def _validate_cuts(problem: Problem, req: Request) -> None:
    if not req.cuts:
        return
    if list(req.cuts) != sorted(set(req.cuts)) or not 0 < req.cuts[0] <= req.cuts[-1] < problem.layers:
        raise PlanError(
            f"cuts {list(req.cuts)} must be increasing layer boundaries between 1 and {problem.layers - 1} "
            f"(the model has {problem.layers} layers after coarsen)"
        )
    pinned = len(req.cuts) + 1
    if req.stages is not None and req.stages != pinned:
        raise PlanError(
            f"split-at makes {pinned} stages ({len(req.cuts)} cuts) but stages={req.stages} was asked for; "
            "give one or the other"
        )
    if (req.virtual or 1) > 1 or req.schedule == "interleaved":
        raise PlanError(
            "split-at fixes one stage per device group; virtual stages (the interleaved schedule) with pinned "
            "cuts are not planned: ask for another schedule, or leave split-at out"
        )
