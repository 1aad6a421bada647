"""`plan`: choose stages, replicas, placement, microbatches and schedule; write the stages.

The planner (`dapple_ir.planner`) proposes and checks candidates with its cost model; this pass gives
it the score that ranks the best few: `lower_and_simulate` lowers a candidate on a copy of the module
(`schedule`, `lower-comm`, `insert-frees`, found by name in the registry) and simulates it.

The simulator prices each candidate's ops at its microbatch size from the same prices the planner reads
(`pricing.ops.OpPrices`, built once per plan: an op the roofline priced priced again at those rows, any
other's fixed part kept); the IR's costs are not touched while candidates are weighed. The plan this pass
writes records every op's time at the chosen microbatch size (`cost_batch` = the microbatch size), so a
later `dapple simulate` of the plan reads what was weighed.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from dapple_ir import schedules
from dapple_ir.analysis.module_cuts import split_layers
from dapple_ir.analysis.tensor_shards import DEFAULT_DEGREES, tp_ok
from dapple_ir.cluster.roofline import rescaled_s
from dapple_ir.cluster.spec import ClusterSpec
from dapple_ir.errors import DappleError, PlanError
from dapple_ir.ir import Module, Op
from dapple_ir.ir.scale import TrialLowering, collector_paused, hand_over, noting
from dapple_ir.planner.cost_model import POLICIES, Candidate, Problem, problem_from_module, roofline_ops
from dapple_ir.planner.search import Outcome, Request, Score, search, write_stages
from dapple_ir.pricing.ops import OpPrices
from dapple_ir.registry import Pass, PassContext, lookup_pass, option, register_pass
from dapple_ir.sim.simulator import predict


@register_pass
@dataclass(frozen=True)
class Plan(Pass):
    """Partition, replicate and place the layers; pick microbatches and schedule (DP, ILP or both)."""

    name = "plan"
    method: str = option("auto", "dp, ilp, or auto (both, best few ranked by the simulator)")
    stages: int | None = option(None, "number of pipeline stages, or auto")
    microbatches: int | None = option(None, "microbatches per step, or auto")
    schedule: str | None = option(None, f"auto or one of {', '.join(schedules.SCHEDULES)}")
    policy: str | None = option(None, f"device placement: auto or one of {', '.join(POLICIES)}")
    virtual: int | None = option(None, "virtual stages per device group (interleaved), or auto")
    recompute: str = option("auto", "activation recomputation: auto (per stage, where needed), none or all")
    replication: str = option("auto", "replicated stages: split each microbatch, round-robin, or auto (both weighed)")
    zero: str = option(
        "none", "ZeRO-1 (sharded optimizer state) of replicated stages: none, auto (where it helps), all"
    )
    global_batch: int = option(0, "samples per step; 0 takes the module's global_batch")
    simulate: bool = option(True, "rank the best candidates with the simulator")
    ilp_time_limit: float = option(10.0, "seconds the CP-SAT solver may take in all")
    split_at: tuple[str, ...] = option(
        (), "modules where a stage begins (torch.distributed.pipelining's SplitPoint.BEGINNING); the rest is planned"
    )
    tensor_parallel: int = option(0, "tensor-parallel degree of every stage (1, 2, 4, 8); 0: searched")
    data_parallel: int = option(0, "replicas of every stage; 0: chosen per stage")

    def apply(self, ctx: PassContext, module: Module) -> None:
        cuts = split_layers(module, self.split_at) if self.split_at else ()
        request = dataclasses.replace(self.request(cuts), progress=ctx.log)
        cluster_text = module.attrs.cluster or ctx.cluster
        if not cluster_text:
            raise PlanError("plan: no cluster; give --cluster (e.g. 2x8xV100-16GB) or set the module's cluster")
        cluster = ctx.cluster_spec(cluster_text)
        global_batch = self.global_batch or module.attrs.global_batch or getattr(ctx, "global_batch", None)
        if not global_batch:
            raise PlanError("plan: no global batch; give plan{global-batch=N} or --global-batch N")
        prices = OpPrices(module, cluster)
        fastest = _FastestTrial()

        def score(trial: Problem, cand: Candidate) -> tuple[float, float]:
            lowered, notes = lowered_trial(module, trial, cand)
            seconds, peak = simulated(lowered, trial, prices, notes)
            fastest.offer(trial, cand, lowered, notes, seconds)
            return seconds, peak

        problem, outcome = _search_degrees(
            module, cluster, int(global_batch), request, self.tensor_parallel, score if self.simulate else None
        )
        write_stages(module, problem, outcome.chosen.cand)
        hand_over(fastest.hand_over(module, problem, outcome.chosen.cand))
        write_costs_at_microbatch(module, problem, outcome.chosen.cand)
        module.attrs.cluster = cluster_text
        module.attrs.predicted_iteration_s = outcome.chosen.time_s
        ctx.reports["plan"] = outcome.explain
        tp = f", tensor-parallel {problem.tp}" if problem.tp > 1 else ""
        ctx.log(f"plan: {outcome.chosen.cand.describe()}{tp}, predicted {outcome.chosen.time_s:.4f} s per iteration")

    def request(self, cuts: tuple[int, ...] = ()) -> Request:
        """What this pass asks the planner for (the planner checks it: `dapple_ir.planner.search.validate`),
        with the layer boundaries `split_at` names as `cuts`."""
        return Request(
            method=self.method,
            stages=self.stages,
            microbatches=self.microbatches,
            schedule=self.schedule,
            policy=self.policy,
            ilp_time_limit_s=self.ilp_time_limit,
            virtual=self.virtual,
            recompute=self.recompute,
            replication=self.replication,
            zero=self.zero,
            data_parallel=self.data_parallel or None,
            cuts=cuts,
        )


def lower_and_simulate(
    module: Module, problem: Problem, cand: Candidate, prices: OpPrices | None = None
) -> tuple[float, float]:
    """(iteration time, worst peak bytes) the simulator predicts for `cand`, lowered on a copy, its ops priced by
    `prices` (by default, the module's on the problem's cluster)."""
    trial, notes = lowered_trial(module, problem, cand)
    return simulated(trial, problem, prices or OpPrices(module, problem.base_cluster or problem.cluster), notes)


def lowered_trial(module: Module, problem: Problem, cand: Candidate) -> tuple[Module, dict[str, object]]:
    """A copy of `module` with `cand`'s stages, lowered (`schedule`, `lower-comm`, `insert-frees`, found by name in
    the registry) as a trial (`ir.scale.noting`: no peaks counted), with what its passes noted for a hand-over."""
    # The lowering passes write stages, programs and module attributes, never ops or parameters: a
    # copy of those three suffices (a deep copy of a large model costs about a second per candidate).
    trial = dataclasses.replace(module, stages=[], programs=[], attrs=copy.copy(module.attrs))
    write_stages(trial, problem, cand)
    ctx = PassContext()
    lowering = [
        lookup_pass("schedule").from_options({"kind": cand.schedule, "virtual": str(cand.virtual)}),
        lookup_pass("lower-comm").from_options({}),
        lookup_pass("insert-frees").from_options({}),
    ]
    # The programs of a thousand ranks are millions of instructions: the collector paused.
    with collector_paused(), noting(trial) as notes:
        for lowering_pass in lowering:
            try:
                lowering_pass.apply(ctx, trial)
            except DappleError as exc:
                raise PlanError(f"pass '{lowering_pass.spec()}' failed: {exc}") from exc
    return trial, notes


def simulated(
    trial: Module, problem: Problem, prices: OpPrices, notes: dict[str, object] | None = None
) -> tuple[float, float]:
    """(iteration time, worst peak bytes) the simulator predicts for a lowered `trial` of `problem`, its ops priced by
    `prices`; its programs' shapes and leads where its passes noted them (`notes`)."""
    shapes, leads = (notes or {}).get("shapes"), (notes or {}).get("leads")
    return predict(
        trial,
        cluster=problem.base_cluster or problem.cluster,
        prices=prices,
        shapes=shapes if isinstance(shapes, list) else None,
        leads=leads if isinstance(leads, dict) else None,
    )


@dataclass
class _FastestTrial:
    """The lowered trial of the fastest candidate scored so far (the first of equals), for `plan` to hand on to the
    lowering passes when it is the one chosen (`ir.scale.TrialLowering`); one at a time, as a thousand ranks' programs
    take gigabytes."""

    problem: Problem | None = None
    cand: Candidate | None = None
    trial: Module | None = None
    notes: dict[str, object] = dataclasses.field(default_factory=dict)
    """What the trial's passes noted for its hand-over (`ir.scale.note`)."""
    seconds: float = float("inf")

    def offer(self, problem: Problem, cand: Candidate, trial: Module, notes: dict[str, object], seconds: float) -> None:
        if seconds < self.seconds:
            self.problem, self.cand, self.trial, self.notes, self.seconds = problem, cand, trial, notes, seconds

    def hand_over(self, module: Module, problem: Problem, cand: Candidate) -> TrialLowering | None:
        """The trial lowering of `cand`, whose stages `module` now has, with the trial's stages put in their place
        where the two are alike (names, ops and attributes): None where the fastest trial is another plan's."""
        trial, self.trial = self.trial, None
        if trial is None or self.problem is not problem or self.cand is not cand:
            return None
        alike = len(trial.stages) == len(module.stages) and all(
            a.name == b.name and a.ops == b.ops and a.attrs == b.attrs
            for a, b in zip(trial.stages, module.stages, strict=True)
        )
        if not alike:
            return None
        module.stages = trial.stages
        graph = (list(module.ops), list(module.params))
        notes, self.notes = self.notes, {}
        return TrialLowering(module, trial.stages, trial.attrs.microbatch_size, trial.programs, graph, notes)


def tensor_degrees(module: Module, cluster: ClusterSpec, forced: int) -> list[int]:
    """The tensor-parallel degrees to plan with: `forced` (refused with the reason where the model or the cluster
    cannot take it; a model without a pattern runs every op replicated in the group), else each of
    `tensor_shards.DEFAULT_DEGREES` that divides a node's devices and the model's split widths and heads; 1 alone
    where the `tensor-parallel` pass found no pattern."""
    if forced:
        reason = _degree_problem(module, cluster, forced)
        if reason:
            raise PlanError(f"plan: tensor-parallel {forced}: {reason}")
        return [forced]
    if not any(op.attrs.tp_role for op in module.ops):
        return [1]
    return [t for t in DEFAULT_DEGREES if not _degree_problem(module, cluster, t)]


def _degree_problem(module: Module, cluster: ClusterSpec, t: int) -> str | None:
    if t < 1:
        return "the degree must be at least 1"
    if cluster.devices_per_node % t:
        return f"a tensor group must sit in one node, and {t} does not divide its {cluster.devices_per_node} devices"
    return tp_ok(module, module.ops, t)


def _grouped_cuts(problem: Problem, cuts: tuple[int, ...]) -> tuple[int, ...]:
    """Pinned cuts (module layer boundaries) as boundaries of the problem's layers (`Problem.layer_map`)."""
    if not problem.layer_map:
        return cuts
    inside = [c for c in cuts if c not in problem.layer_map]
    if inside:
        raise PlanError(
            f"plan: tensor-parallel {problem.tp}: a pinned cut at layer {inside[0]} falls inside a tensor-parallel "
            "pattern (between a column-parallel matmul and its row-parallel partner), whose split values cannot "
            "cross stages; cut at a block boundary"
        )
    return tuple(problem.layer_map.index(c) for c in cuts)


def _search_degrees(
    module: Module, cluster: ClusterSpec, global_batch: int, request: Request, forced: int, score: Score | None
) -> tuple[Problem, Outcome]:
    """The best plan over the tensor-parallel degrees (`tensor_degrees`): one search per degree on its grouped view
    of the cluster, the fastest outcome by its own ranking (simulated where `score` is given). A degree where no
    plan fits loses; where none fits at all, the error of degree 1 (or of the forced one) stands."""
    best: tuple[Problem, Outcome] | None = None
    failure: PlanError | None = None
    for t in tensor_degrees(module, cluster, forced):
        problem = problem_from_module(module, cluster, global_batch, t)
        try:
            asked = dataclasses.replace(request, tensor_parallel=t, cuts=_grouped_cuts(problem, request.cuts))
            outcome = search(problem, asked, score)
        except PlanError as exc:
            failure = failure or exc
            continue
        if best is None or outcome.chosen.time_s < best[1].chosen.time_s:
            if best is not None:
                outcome.explain.append(f"tensor-parallel {best[0].tp}: best {best[1].chosen.time_s:.4f} s, lost")
            best = (problem, outcome)
        else:
            best[1].explain.append(f"tensor-parallel {t}: best {outcome.chosen.time_s:.4f} s, lost")
    if best is None:
        assert failure is not None
        raise failure
    return best


Costs = tuple[float | None, float | None, float | None]


def _costs_at(module: Module, problem: Problem, cand: Candidate) -> list[tuple[Op, Costs]]:
    """Each op's (forward s, backward s, activation bytes) at `cand`'s microbatch size, from the
    module's costs at its `cost_batch`: an op the roofline priced priced again (`roofline_ops`), any other
    time keeping its fixed part (`rescaled_s`, the planning cluster's device kind, as `problem_from_module`
    counts it); activation bytes scale."""
    old = module.attrs.cost_batch or module.attrs.batch
    new = problem.microbatch_size(cand.microbatches)
    if not old or old == new:
        return []
    kind = problem.cluster.device(0)
    priced = roofline_ops(module, problem.cluster)

    def time(seconds: float | None) -> float | None:
        return None if seconds is None else rescaled_s(seconds, old, new, kind)

    def size(nbytes: float | None) -> float | None:
        return None if nbytes is None else nbytes * new / old

    def times(op: Op) -> tuple[float | None, float | None]:
        return priced[op].times(new, kind) if op in priced else (time(op.attrs.fwd_s), time(op.attrs.bwd_s))

    return [(op, (*times(op), size(op.attrs.act_bytes))) for op in module.ops]


def write_costs_at_microbatch(module: Module, problem: Problem, cand: Candidate) -> None:
    """Every op's costs, and the coarsened layers' sums of them, at `cand`'s microbatch size, which
    becomes the module's `cost_batch`: what the plan, and a simulation of it, price."""
    for op, costs in _costs_at(module, problem, cand):
        op.attrs.fwd_s, op.attrs.bwd_s, op.attrs.act_bytes = costs
    for layer in module.layers:
        layer.attrs.fwd_s = sum(op.attrs.fwd_s or 0.0 for op in layer.ops)
        layer.attrs.bwd_s = sum(op.attrs.bwd_s or 0.0 for op in layer.ops)
        layer.attrs.act_bytes = sum(op.attrs.act_bytes or 0.0 for op in layer.ops)
    module.attrs.cost_batch = problem.microbatch_size(cand.microbatches)
