"""Model FLOPs utilization of the plans the planner makes for large models on GPU clusters, by precision and ZeRO-1.

For each case the model is captured once on the meta device, then planned (`dapple_ir.compile`, planner defaults,
Adam) at each setting; the table gives the plan, its predicted iteration (the simulator's, as `--explain` ranks it),
the hardware floor (model FLOPs over the devices' matmul peak at the plan's precision, `analysis/mfu.py`) and the
predicted MFU. A prediction below the floor would be a bug (`tests/test_precision.py` refuses one). Prints a table;
asserts nothing.

    .venv/bin/python bench/mfu.py [--budget 280] [--cases 7b,70b]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (name, model spec, cluster, global batch, issue 44's target MFU).
CASES = {
    "7b": ("Llama-2-7B, seq 2048", "examples/llama.py:factory_7b", "4x8xH100", 64, 0.35),
    "70b": ("Llama-2-70B, seq 2048", "examples/llama.py:factory_70b", "8x8xH100", 512, 0.40),
}
#: (label, precision, zero, recompute) of each row: the last two show what recomputing only where a stage needs it
#: (`auto`, the planner's default) buys over recomputing every stage, and that without it no plan fits at all.
SETTINGS = (
    ("fp32", "fp32", "none", "auto"),
    ("bf16", "bf16", "none", "auto"),
    ("bf16 + ZeRO-1", "bf16", "auto", "auto"),
    ("bf16 + ZeRO-1, recompute all", "bf16", "auto", "all"),
    ("bf16 + ZeRO-1, recompute none", "bf16", "auto", "none"),
)
LABEL = max(len(label) for label, *_ in SETTINGS)


def plan_row(
    module: object, cluster: str, global_batch: int, precision: str, zero: str, recompute: str
) -> tuple[str, float, str]:
    """(plan, predicted iteration s, utilization line) of one setting."""
    from dapple_ir.analysis.mfu import utilization
    from dapple_ir.api import compile as compile_plan
    from dapple_ir.cluster.toml_file import resolve_cluster

    result = compile_plan(
        copy.deepcopy(module),  # type: ignore[arg-type]
        cluster=cluster,
        global_batch=global_batch,
        precision=precision,
        zero=zero,
        recompute=recompute,
    )
    iteration = float(result.plan["predicted_iteration_s"])
    use = utilization(result.module, resolve_cluster(cluster))
    chosen = next((line for line in result.explain if line.startswith("chosen")), "")
    stages = result.module.stages
    zeroed = sum(1 for s in stages if s.sharded)
    attrs = result.module.attrs
    sharded = f" ({zeroed} ZeRO-1)" if zeroed else ""
    replicas = ",".join(str(s.replicas) for s in stages)
    degrees = sorted({s.attrs.tp or 1 for s in stages})
    tp = f" T={','.join(map(str, degrees))}" if degrees != [1] else ""
    plan = f"{len(stages)} stages, replicas {replicas}{sharded}{tp}, M={attrs.microbatches} {attrs.schedule}"
    return plan or chosen, iteration, f"{100 * use.mfu(iteration):.1f} % (floor {use.floor_s:.3f} s)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=280.0, help="seconds; no case starts past it")
    parser.add_argument("--cases", default="7b,70b", help=f"comma-separated, of {', '.join(CASES)}")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from dapple_ir.errors import PlanError
    from dapple_ir.frontend.spec_loader import capture_spec

    started = time.time()
    print(f"{'model':<24} {'cluster':<9} {'batch':>5}  {'setting':<{LABEL}} {'plan':<52} {'iteration s':>11}  MFU")
    for key in args.cases.split(","):
        name, spec, cluster, global_batch, target = CASES[key]
        if time.time() - started > args.budget:
            print(f"{name:<24} {cluster:<9} {global_batch:>5}  not run: past the {args.budget:.0f} s budget")
            continue
        module = capture_spec(str(ROOT / spec.split(":")[0]) + ":" + spec.split(":")[1], device="meta")
        for label, precision, zero, recompute in SETTINGS:
            head = f"{name:<24} {cluster:<9} {global_batch:>5}  {label:<{LABEL}}"
            if time.time() - started > args.budget:
                print(f"{head} not run: past the budget")
                continue
            try:
                plan, iteration, use = plan_row(module, cluster, global_batch, precision, zero, recompute)
            except PlanError as exc:  # recompute none: the memory advice says where it would fit
                print(f"{head} no plan: {' '.join(str(exc).split())}")
                continue
            print(f"{head} {plan:<52} {iteration:>11.3f}  {use}")
        print(f"{'':<24} issue 44's target for this case: {100 * target:.0f} % MFU")
    print(
        "\nMFU = model FLOPs per iteration / (predicted iteration x devices x matmul peak at the plan's precision);"
        " fp32 rows against the f32 peak. Planner defaults otherwise (recomputation auto, schedule auto)."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
