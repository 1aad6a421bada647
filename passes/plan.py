"""`plan`: choose stages, replicas, placement, microbatches and schedule; write the stages."""

from __future__ import annotations

from dataclasses import dataclass, field

from dapple_ir.cluster.spec import resolve_cluster
from dapple_ir.errors import PlanError
from dapple_ir.ir import Module
from dapple_ir.planner.cost_model import POLICIES, SCHEDULES, problem_from_module
from dapple_ir.planner.search import Request, search, write_stages
from dapple_ir.registry import Pass, PassContext, register_pass

_METHODS = ("auto", "dp", "ilp")


@register_pass
@dataclass(frozen=True)
class Plan(Pass):
    """Partition, replicate and place the layers; pick microbatches and schedule (DP, ILP or both)."""

    name = "plan"
    method: str = field(default="auto", metadata={"doc": "dp, ilp, or auto (both, best few ranked by the simulator)"})
    stages: str = field(default="auto", metadata={"doc": "number of pipeline stages, or auto"})
    microbatches: str = field(default="auto", metadata={"doc": "microbatches per step, or auto"})
    schedule: str = field(default="auto", metadata={"doc": f"auto or one of {', '.join(SCHEDULES)}"})
    policy: str = field(default="auto", metadata={"doc": f"device placement: auto or one of {', '.join(POLICIES)}"})
    global_batch: int = field(default=0, metadata={"doc": "samples per step; 0 takes the module's global_batch"})
    simulate: bool = field(default=True, metadata={"doc": "rank the best candidates with the simulator"})
    ilp_time_limit: float = field(default=10.0, metadata={"doc": "seconds the CP-SAT solver may take in all"})

    def apply(self, ctx: PassContext, module: Module) -> None:
        request = self.request()
        cluster_text = module.attrs.cluster or ctx.cluster
        if not cluster_text:
            raise PlanError("plan: no cluster; give --cluster (e.g. 2x8xV100-16GB) or set the module's cluster")
        cluster = resolve_cluster(cluster_text)
        global_batch = self.global_batch or module.attrs.global_batch or getattr(ctx, "global_batch", None)
        if not global_batch:
            raise PlanError("plan: no global batch; give plan{global-batch=N} or --global-batch N")
        problem = problem_from_module(module, cluster, int(global_batch))
        outcome = search(module, problem, request, simulate=self.simulate)
        write_stages(module, problem, outcome.chosen.cand)
        module.attrs.cluster = cluster_text
        module.attrs.predicted_iteration_s = outcome.chosen.time_s
        ctx.reports["plan"] = outcome.explain
        ctx.log(f"plan: {outcome.chosen.cand.describe()}, predicted {outcome.chosen.time_s:.4f} s per iteration")

    def request(self) -> Request:
        if self.method not in _METHODS:
            raise PlanError(f"plan: method must be one of {', '.join(_METHODS)}, not '{self.method}'")
        if self.schedule not in ("auto", *SCHEDULES):
            raise PlanError(f"plan: schedule must be auto or one of {', '.join(SCHEDULES)}, not '{self.schedule}'")
        if self.policy not in ("auto", *POLICIES):
            raise PlanError(f"plan: policy must be auto or one of {', '.join(POLICIES)}, not '{self.policy}'")
        return Request(
            method=self.method,
            stages=_count("stages", self.stages),
            microbatches=_count("microbatches", self.microbatches),
            schedule=None if self.schedule == "auto" else self.schedule,
            policy=None if self.policy == "auto" else self.policy,
            ilp_time_limit_s=self.ilp_time_limit,
        )


def _count(option: str, text: str) -> int | None:
    if text == "auto":
        return None
    if not text.isdigit() or int(text) < 1:
        raise PlanError(f"plan: {option} must be auto or a positive integer, not '{text}'")
    return int(text)
