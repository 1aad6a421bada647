"""The one memory advice when nothing fits: the smallest cluster of the same kind (or the microbatch
count, or recomputation) with which the planner finds a plan (`MemoryAdvice`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dapple_ir.cluster.spec import ClusterSpec, parse_shorthand
from dapple_ir.errors import PlanError
from dapple_ir.planner.cost_model import Problem
from dapple_ir.planner.gather import divisors
from dapple_ir.planner.memory_fit import leanest_plan, tightest_layer
from dapple_ir.planner.ranking import rank
from dapple_ir.planner.request import RECOMPUTE_SCHEDULES, Request
from dapple_ir.planner.scoring import Score
from dapple_ir.units import GB

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
    schedule = req.schedule or "1f1b"
    rerun = req.recompute != "none" and schedule in RECOMPUTE_SCHEDULES and (req.virtual or 1) == 1
    needs = {
        m: lean.devices
        for m in divisors(g)
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
    asks = _Asks(req, score, needs)
    least = min(needs.values())
    if req.microbatches is not None and least <= cluster.num_devices:
        here = asks.first_that_plans(problem, as_given=False)  # as given, it just failed
        if here is not None and here.microbatches is not None:
            m = here.microbatches
            return MemoryAdvice(
                f"It fits on {cluster.name} with --microbatches {m} (microbatch size {g // m}).", cluster.name, m, least
            )
    return _smallest_cluster(problem, asks, least)


@dataclass(frozen=True)
class _Asks:
    """The requests the advice plans: the user's, and (when it forces a microbatch count) the same with
    each other count the memory model allows on the cluster tried."""

    req: Request
    score: Score | None
    needs: dict[int, int]
    """The fewest devices the memory model allows, per microbatch count that fits on any."""

    def first_that_plans(self, trial: Problem, *, as_given: bool) -> Request | None:
        req, needs = self.req, self.needs
        fits = [m for m in sorted(needs) if needs[m] <= trial.cluster.num_devices and m != req.microbatches]
        counts = fits if req.microbatches is not None else []
        asks = ([req] if as_given else []) + [dataclasses.replace(req, microbatches=m) for m in counts]
        return next((ask for ask in asks if _plans(trial, ask, self.score)), None)


def _smallest_cluster(problem: Problem, asks: _Asks, least: int) -> MemoryAdvice:
    """The fewest nodes, from `least` devices up to `ADVICE_MAX_DEVICES` (at most `ADVICE_MAX_CLUSTERS`
    planned), on which one of `asks` plans; else the advice that none up to there does."""
    cluster, req = problem.cluster, asks.req
    each = f"{cluster.device(0).name} devices ({problem.capacity(0) / GB:.1f} GB each)"
    per, tried = cluster.devices_per_node, list[str]()
    last = ADVICE_MAX_DEVICES // per
    for nodes in range(max(1, -(-least // per)), last + 1):
        if nodes == cluster.nodes:
            continue
        if len(tried) == ADVICE_MAX_CLUSTERS:
            last = nodes - 1
            break
        name, bigger = _resized(cluster, nodes)
        ask = asks.first_that_plans(dataclasses.replace(problem, cluster=bigger), as_given=True)
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
        rank(problem, req, score)
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
