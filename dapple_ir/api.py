"""`compile`: a model spec (or module) and a cluster in, a plan directory out.

result = dapple_ir.compile("examples/gpt.py:factory", cluster="2x8xV100-16GB", global_batch=64,
                           out_dir="plans/gpt")
print(result.report)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dapple_ir import plan_dir
from dapple_ir.analysis.experts import expert_lines
from dapple_ir.analysis.mfu import model_flops, utilization
from dapple_ir.analysis.precision import check_precision, default_precision, precision_of
from dapple_ir.cluster.spec import ClusterSpec
from dapple_ir.errors import DappleError, PlanError
from dapple_ir.ir import Module, OpKind
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.planner.search import METHODS
from dapple_ir.registry import PassContext
from dapple_ir.units import GB


@dataclass
class CompileResult:
    """A compiled plan: the lowered module, plan.json's contents and the human report."""

    module: Module
    plan: dict[str, Any]
    report: str
    explain: list[str] = field(default_factory=list)
    out_dir: Path | None = None
    pipeline: str = ""


def default_pipeline(
    *,
    profile: bool,
    planner: str = "auto",
    stages: int | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
    policy: str | None = None,
    max_layers: int | None = None,
    virtual: int | None = None,
    recompute: str = "auto",
    replication: str = "auto",
    zero: str = "none",
    precision: str = "fp32",
    split_at: tuple[str, ...] = (),
    tensor_parallel: int | None = None,
    data_parallel: int | None = None,
) -> str:
    """The whole default pipeline: the tensor-parallel patterns and costs (not for profiles), coarsen, plan, then the
    lowering passes.

    `schedule` takes the kind `plan` chose, so one pass manager runs it all (one numbering of dumps).
    `split_at` (module names where a stage begins) pins the plan's cuts, and coarsen keeps them.
    """
    options = [f"method={planner}"]
    for key, value in (("stages", stages), ("microbatches", microbatches), ("schedule", schedule), ("policy", policy)):
        if value is not None:
            options.append(f"{key}={value}")
    if virtual is not None:
        options.append(f"virtual={virtual}")
    if recompute != "auto":
        options.append(f"recompute={recompute}")
    if replication != "auto":
        options.append(f"replication={replication}")
    if zero != "none":
        options.append(f"zero={zero}")
    for key, count in (("tensor-parallel", tensor_parallel), ("data-parallel", data_parallel)):
        if count is not None:
            options.append(f"{key}={count}")
    keep = ";".join(split_at)
    if keep:
        options.append(f"split-at={keep}")
    coarsen_options = ([f"max-layers={max_layers}"] if max_layers else []) + ([f"keep={keep}"] if keep else [])
    coarsen = "coarsen{" + ",".join(coarsen_options) + "}" if coarsen_options else "coarsen"
    costs = "annotate-cost" if precision == "fp32" else f"annotate-cost{{precision={precision}}}"
    front = [] if profile else ["tensor-parallel", costs]
    return ",".join([*front, coarsen, "plan{" + ",".join(options) + "}", "schedule,lower-comm,insert-frees,verify"])


#: The largest global batch compile accepts: far beyond any real step (16.7M samples), small enough
#: that the planner's search over microbatch counts stays bounded.
MAX_GLOBAL_BATCH = 2**24


def compile(
    model_spec: str | Module,
    *,
    cluster: str,
    global_batch: int,
    planner: str = "auto",
    stages: int | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
    policy: str | None = None,
    pipeline: str | None = None,
    out_dir: str | Path | None = None,
    explain: bool = False,
    optimizer: str = "adam",
    profile_batch: int | None = None,
    max_layers: int | None = None,
    log: Callable[[str], None] | None = None,
    manager: dict[str, Any] | None = None,
    force: bool = False,
    virtual: int | None = None,
    recompute: str = "auto",
    replication: str = "auto",
    zero: str = "none",
    precision: str | None = None,
    split_at: tuple[str, ...] = (),
    tensor_parallel: int | None = None,
    data_parallel: int | None = None,
) -> CompileResult:
    """Capture (or import) the model, plan it for `cluster`, lower it, and write `out_dir` atomically.

    `out_dir` may be new, empty or a previous plan; a directory holding other files is refused
    before any work unless `force`. `precision` (fp32, bf16, fp16) is the autocast dtype the plan trains
    in; None: bf16 where the cluster's devices have a bf16 tensor-core rate, else fp32 (`default_precision`).
    `split_at` names the modules where a stage begins (torch.distributed.pipelining's split points): those
    cuts are fixed, and everything else is planned. `log` receives the progress as each phase ends (capture, each
    pass with its time, the planner's candidates as it simulates them, writing) and the passes' notes."""
    _check_request(planner, global_batch, stages, microbatches, precision, pipeline)
    if out_dir is not None:
        plan_dir.check_output(Path(out_dir), force=force)
    say: Callable[[str], None] = log or (lambda _m: None)
    ctx = PassContext(cluster=cluster, log=say)
    resolved = ctx.cluster_spec(cluster)  # read once, here: capture, the passes and the report all take this one
    start = time.perf_counter()
    module, spec_text = _load(model_spec, profile_batch, resolved)
    say(f"capture: {len(module.ops)} ops in {time.perf_counter() - start:.2f} s")
    from dapple_ir.ir.structure import structure_hash

    model_hash = structure_hash(module)
    module.attrs.global_batch = global_batch
    module.attrs.optimizer = optimizer
    module.attrs.cluster = cluster
    options = dict(manager or {})
    profile = module.attrs.capture_method == "profile"
    chosen = _precision(precision, resolved, profile)
    text = pipeline or default_pipeline(
        profile=profile,
        planner=planner,
        stages=stages,
        microbatches=microbatches,
        schedule=schedule,
        policy=policy,
        max_layers=max_layers,
        virtual=virtual,
        recompute=recompute,
        replication=replication,
        zero=zero,
        precision=chosen,
        split_at=split_at,
        tensor_parallel=tensor_parallel,
        data_parallel=data_parallel,
    )
    PassManager(build_pipeline(text), **options).run(module, ctx)
    plan = plan_json(module, spec_text, model_hash, optimizer)
    planner_lines = ctx.reports.get("plan", [])
    explain_lines = [*planner_lines, *expert_lines(module)]
    report = report_text(
        module, plan, explain_lines if explain else planner_lines[:8], mfu=resolved if explain else None
    )
    result = CompileResult(module, plan, report, explain_lines, Path(out_dir) if out_dir else None, text)
    if out_dir is not None:
        start = time.perf_counter()
        write_plan_dir(result, Path(out_dir), runnable=not profile)
        say(f"write: {out_dir} in {time.perf_counter() - start:.2f} s")
    return result


def _check_request(
    planner: str,
    global_batch: int,
    stages: int | None,
    microbatches: int | None,
    precision: str | None,
    pipeline: str | None,
) -> None:
    """Refuse a compile request that cannot plan, before anything is captured."""
    if planner not in METHODS:
        raise DappleError(f"planner must be one of {', '.join(METHODS)}, not '{planner}'")
    if not 1 <= global_batch <= MAX_GLOBAL_BATCH:
        raise PlanError(
            f"global batch must be a positive integer of at most {MAX_GLOBAL_BATCH:,} samples per step, "
            f"not {global_batch:,}"
        )
    for name, count in (("stages", stages), ("microbatches", microbatches)):
        if count is not None and not 1 <= count <= global_batch:
            raise PlanError(f"--{name} must lie between 1 and the global batch ({global_batch}), not {count:,}")
    if microbatches is not None and (microbatches < 1 or global_batch % microbatches):
        raise PlanError(
            f"global batch {global_batch} is not divisible into {microbatches} microbatches; "
            f"choose --microbatches among the divisors of {global_batch}"
        )
    if precision is not None:
        check_precision(precision)
    if precision is not None and pipeline is not None:
        raise DappleError(
            f"precision {precision} and a whole --pipeline were both given: write it into the pipeline's "
            f"annotate-cost{{precision={precision}}} instead"
        )


def _precision(given: str | None, cluster: ClusterSpec, profile: bool) -> str:
    """The precision a plan trains in: the one given, else the cluster's device's default; a profile's
    times were measured, so it plans at the precision it was measured in (fp32)."""
    if profile and given not in (None, "fp32"):
        raise DappleError(
            f"precision {given}: a profile's times were measured, not priced, so they cannot be re-priced in 16-bit; "
            "plan it at fp32 or profile the model at that precision"
        )
    if profile or given is not None:
        return given or "fp32"
    return default_precision(cluster.device(0).peak_flops)


def _load(model_spec: str | Module, profile_batch: int | None, cluster: ClusterSpec) -> tuple[Module, str]:
    if isinstance(model_spec, Module):
        return model_spec, model_spec.attrs.source or model_spec.name
    from dapple_ir.frontend.spec_loader import capture_spec

    # Traced as if on the cluster's device, so code that picks its kernels by device picks that device's.
    return capture_spec(model_spec, device="meta", profile_batch=profile_batch, cluster=cluster), model_spec


def _node_name(op: Any) -> str:
    return str(op.target) if op.kind is OpKind.LAYER and op.target else str(op.name)


def plan_json(module: Module, spec: str, model_hash: str, optimizer: str) -> dict[str, Any]:
    """plan.json's contents (the field names are fixed: other tools read them). `plan_dir.write_plan_json`
    adds the hashes of the plan's files and of the model spec's file, and the digest over them all."""
    peaks = {
        str(p.attrs.device if p.attrs.device is not None else k): float(p.attrs.peak_bytes or 0.0)
        for k, p in enumerate(module.programs)
    }
    a = module.attrs
    return {
        "stages": [
            {
                "name": s.name,
                "nodes": [_node_name(op) for op in s.ops],
                "devices": list(s.attrs.devices or ()),
                "tensor_parallel": s.tp,
            }
            for s in module.stages
        ],
        "microbatches": a.microbatches,
        "microbatch_size": a.microbatch_size,
        "schedule": a.schedule,
        "predicted_iteration_s": a.predicted_iteration_s,
        "peak_bytes": peaks,
        "model_spec": spec,
        "model_hash": model_hash,
        "cluster": a.cluster,
        "global_batch": a.global_batch,
        "optimizer": optimizer,
        "precision": precision_of(module),
        "lr": None,  # the optimizer's default (`dapple run --lr` overrides it)
        "ranks": len(module.programs),
        "seed": 0,
    }


def report_text(module: Module, plan: dict[str, Any], explain: list[str], *, mfu: ClusterSpec | None = None) -> str:
    """report.txt: the plan in a few lines; with `mfu`, the plan's resolved cluster (`--explain`), its model FLOPs,
    predicted MFU and floor on it."""
    gb = GB
    lines = [
        f"model {plan['model_spec']} on {plan['cluster']}: global batch {plan['global_batch']} = "
        f"{plan['microbatches']} microbatches x {plan['microbatch_size']}, schedule {plan['schedule']}, "
        f"{plan['ranks']} ranks, precision {precision_of(module)}",
        f"predicted iteration {plan['predicted_iteration_s']:.4f} s",
    ]
    if mfu is not None and model_flops(module):
        lines += utilization(module, mfu).lines(plan["predicted_iteration_s"])
    peaks = plan["peak_bytes"]
    for stage in module.stages:
        devices = list(stage.attrs.devices or ())
        worst = max((peaks.get(str(d), 0.0) for d in devices), default=0.0)
        lines.append(
            f"  stage {stage.name}: {len(stage.ops)} ops, {stage.replicas} replica(s)"
            f"{f' x tensor-parallel T={stage.tp}' if stage.tp > 1 else ''} on devices {devices}, "
            f"peak {worst / gb:.2f} GB"
        )
    if explain:
        lines += ["", *explain]
    return "\n".join(lines) + "\n"


def write_plan_dir(result: CompileResult, out: Path, *, runnable: bool) -> None:
    """Write the plan directory; a runnable plan gets the torch backend's rank programs."""
    emit: Callable[[Module, Path], object] | None = None
    if runnable:
        from dapple_ir.backends.torch.codegen import emit_rank_programs

        emit = emit_rank_programs
    plan_dir.write_plan_dir(out, result.module, result.plan, result.report, emit)
