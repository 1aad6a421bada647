"""Megatron-LM's weak-scaling table, predicted: its own configurations forced as plans, and the planner's own plans.

For each row of Narayanan et al., SC'21, Table 1 (`examples/megatron_gpt.py`: GPT, vocabulary 51,200, sequence
2,048, on (GPUs/8) DGX A100 80 GB nodes) the model is captured once on the meta device and compiled twice with
`dapple_ir.compile`, in fp16 with Adam:

(a) Megatron's configuration forced: its pipeline stages (`stages`), tensor- and data-parallel sizes
    (`tensor_parallel`, `data_parallel`, where this build has them; without them a row with TP > 1 is
    "pending" and the replicas are the planner's), full activation recomputation,
    replicas taking whole microbatches of Megatron's microbatch size (`replication=round-robin`,
    `microbatches = batch / MBS`, so that each of the DP = GPUs / (TP PP) replicas of a stage runs
    batch / (DP MBS) microbatches, Megatron's per-pipeline count), and its schedule;
(b) the planner's own plan: `precision=fp16` and nothing else forced.

Each plan's predicted iteration (the simulator's, as `--explain` ranks it) becomes TFLOP/s per GPU by the paper's
Eq. 3 (`megatron_gpt.tflops_per_gpu`, the FLOPs Megatron counts, recomputation included, over all the row's
GPUs), printed beside the published figure with their ratio. The floor is the iteration at 100 % of the fp16
peak with no recomputation: the captured model FLOPs (forward and backward, `analysis.mfu.model_flops`) over
GPUs x 312 TFLOP/s; "at floor" is Eq. 3's TFLOP/s per GPU at that time, the most any plan can report
(about 4/3 x 312, since Eq. 3 counts the recomputed forward). A prediction faster than the floor is a bug.

What the paper does not state, taken from Megatron-LM's script for this table (`examples/sc21/run_table_1.sh`
in NVIDIA/Megatron-LM, which the SC'21 artifact names): the microbatch size per row (16, 16, 16, 8, 4, 2, 2, 1,
1, 1) and the schedule. The paper (Section 5.1) says the table ran the interleaved schedule with the
scatter/gather optimisation; the script sets `--num-layers-per-virtual-pipeline-stage` 5, 5, 3, 1 for 76.1B,
145.6B, 310.1B and 529.6B, i.e. 3, 2, 2 and 3 virtual stages per device, and none for 1008B (2 layers per stage:
plain 1F1B) or for 39.1B (Megatron refuses interleaving on 2 stages). Rows with one stage have no schedule to
speak of (1f1b). Every row recomputes all activations (`--recompute-method uniform`); all are fp16 with loss
scaling. Megatron's timings include the optimizer step, data loading and logging (its README), which the
simulator prices as the optimizer step only.

    .venv/bin/python bench/megatron_table.py [--rows 1.7B,39.1B] [--settings ab] [--budget 600] [--out table.md]
        [--json PATH]

`main(argv)` is what `bench/run_all.py` calls. Rows past the budget are printed as not run; a compile that
fails prints its error. Asserts nothing.
"""

from __future__ import annotations

import copy
import inspect
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

from tables import Report, Table, bench_parser  # noqa: E402

from examples.megatron_gpt import ROWS, SEQ, MegatronRow, eq3_flops, tflops_per_gpu  # noqa: E402

#: fp16 tensor-core peak of an A100 (dense), FLOP/s: what the floor divides by.
A100_FP16_PEAK = 312e12


@dataclass(frozen=True)
class MegatronRun:
    """What Megatron-LM's script for Table 1 runs that the table itself does not state."""

    micro_batch: int
    """`--micro-batch-size`."""
    virtual: int
    """Model chunks per device of the interleaved schedule (1: plain 1F1B)."""


#: Per row name, from `examples/sc21/run_table_1.sh` (see the module docstring).
MEGATRON_RUNS = {
    "1.7B": MegatronRun(16, 1),
    "3.6B": MegatronRun(16, 1),
    "7.5B": MegatronRun(16, 1),
    "18.4B": MegatronRun(8, 1),
    "39.1B": MegatronRun(4, 1),
    "76.1B": MegatronRun(2, 3),
    "145.6B": MegatronRun(2, 2),
    "310.1B": MegatronRun(1, 2),
    "529.6B": MegatronRun(1, 3),
    "1008B": MegatronRun(1, 1),
}

COLUMNS = [
    "model",
    "GPUs",
    "batch",
    "published",
    "setting",
    "plan",
    "iteration s",
    "TFLOP/s/GPU",
    "ratio",
    "floor s",
    "at floor",
    "compile s",
]


def has_tensor_parallel() -> bool:
    """Whether this build's `compile` takes tensor- and data-parallel degrees."""
    from dapple_ir.api import compile as compile_plan

    return {"tensor_parallel", "data_parallel"} <= set(inspect.signature(compile_plan).parameters)


def forced_options(r: MegatronRow, tensor_parallel: bool) -> dict[str, Any]:
    """The `compile` keywords that force Megatron's configuration of row `r` (see the module docstring)."""
    run = MEGATRON_RUNS[r.name]
    options: dict[str, Any] = {
        # A plan's stages count virtual ones: P devices deep, V chunks each.
        "stages": r.pipeline * run.virtual,
        "microbatches": r.batch // run.micro_batch,
        "replication": "round-robin",
        "recompute": "all",
        "schedule": "interleaved" if run.virtual > 1 else "1f1b",
    }
    if run.virtual > 1:
        options["virtual"] = run.virtual
    if tensor_parallel:
        options["tensor_parallel"] = r.tensor
        options["data_parallel"] = r.data
    return options


def plan_text(module: Any) -> str:
    """Stages, replicas (and T where > 1), microbatches and schedule of a compiled module."""
    stages = module.stages
    replicas = ",".join(str(s.replicas) for s in stages)
    tps = {s.attrs.tp or 1 for s in stages}
    tp = f" T={','.join(str(t) for t in sorted(tps))}" if tps != {1} else ""
    recomputed = sum(1 for s in stages if s.attrs.recompute)
    attrs = module.attrs
    # Interleaved stages share their device groups: V stages per group.
    virtual = len(stages) // (len({s.attrs.devices for s in stages}) or 1)
    schedule = f"{attrs.schedule} v={virtual}" if virtual > 1 else str(attrs.schedule)
    return f"S={len(stages)} R={replicas}{tp} M={attrs.microbatches} {schedule} recompute {recomputed}/{len(stages)}"


def floor_s(module: Any, r: MegatronRow) -> float:
    """The iteration at 100 % of the fp16 peak without recomputation: model FLOPs over the row's GPUs' peak."""
    from dapple_ir.analysis.mfu import model_flops

    return model_flops(module) / (r.gpus * A100_FP16_PEAK)


def compile_row(module: Any, r: MegatronRow, options: dict[str, Any]) -> tuple[str, float, float, float]:
    """(plan, predicted iteration s, floor s, compile s) of one compile of row `r`."""
    from dapple_ir.api import compile as compile_plan

    started = time.perf_counter()
    result = compile_plan(copy.deepcopy(module), cluster=r.cluster, global_batch=r.batch, precision="fp16", **options)
    seconds = time.perf_counter() - started
    return plan_text(result.module), float(result.plan["predicted_iteration_s"]), floor_s(result.module, r), seconds


def failure_text(exc: Exception) -> str:
    """The reason a compile gave, without the pass pipeline it names first."""
    text = str(exc).splitlines()[0]
    return text.split("): ", 1)[-1] if text.startswith("pass ") else f"{type(exc).__name__}: {text}"


def add_setting(table: Table, module: Any, r: MegatronRow, setting: str, options: dict[str, Any] | None) -> bool:
    """One line of the table: a setting compiled and priced, or why it was not; whether it compiled."""
    head = [r.name, r.gpus, r.batch, r.tflops, setting]
    if options is None:
        table.add(*head, f"pending: TP={r.tensor} needs --tensor-parallel", *[None] * 6)
        return False
    try:
        plan, iteration, floor, seconds = compile_row(module, r, options)
    except Exception as exc:  # a row that cannot plan is reported, and the others still run
        table.add(*head, f"failed: {failure_text(exc)[:240]}", *[None] * 6)
        print(f"[megatron_table] {r.name} {setting}: failed: {failure_text(exc)}", file=sys.stderr)
        return False
    print(
        f"[megatron_table] {r.name} {setting}: {plan}, {iteration:.3f} s, compiled in {seconds:.1f} s", file=sys.stderr
    )
    tflops = tflops_per_gpu(r, iteration)
    at_floor = eq3_flops(r.batch, SEQ, r.layers, r.hidden, 51_200) / (floor * r.gpus) / 1e12
    table.add(*head, plan, iteration, tflops, tflops / r.tflops, floor, at_floor, seconds)
    return True


def relaxations(forced: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Megatron's configuration, then what is left of it where this build cannot plan it: the microbatch count
    left to the planner (Megatron's microbatch size does not fit where recomputation keeps more than its per-layer
    checkpoints), then also plain 1F1B for an interleaved schedule (where recomputation is not modelled)."""
    free = {k: v for k, v in forced.items() if k != "microbatches"}
    steps = [("(a) Megatron's", forced), ("(a) M free", free)]
    if forced["schedule"] == "interleaved":
        plain = {k: v for k, v in free.items() if k != "virtual"}
        steps.append(("(a) M free, 1f1b", {**plain, "schedule": "1f1b"}))
    return steps


def add_megatrons(table: Table, module: Any, r: MegatronRow, forced: dict[str, Any] | None) -> None:
    """Megatron's configuration of row `r`, relaxed step by step (`relaxations`) until one compiles."""
    if forced is None:
        add_setting(table, module, r, "(a) Megatron's", None)
        return
    for setting, options in relaxations(forced):
        if add_setting(table, module, r, setting, options):
            return


def not_run(table: Table, r: MegatronRow, why: str) -> None:
    table.add(r.name, r.gpus, r.batch, r.tflops, "-", why, *[None] * 6)


def run_rows(
    rows: list[MegatronRow], budget: float, report: Report, json_path: str | None, settings: str = "ab"
) -> None:
    """Capture each row and compile its two settings while the budget lasts, saving the report after each."""
    from dapple_ir.frontend.spec_loader import capture_spec

    table = report.tables[0]
    tensor_parallel = has_tensor_parallel()
    started = time.time()
    for r in rows:
        if time.time() - started > budget:
            not_run(table, r, f"not run: past the {budget:.0f} s budget")
            continue
        module = capture_spec(f"{ROOT / 'examples' / 'megatron_gpt.py'}:{r.factory_name}", device="meta")
        forced = forced_options(r, tensor_parallel) if tensor_parallel or r.tensor == 1 else None
        if "a" in settings:
            add_megatrons(table, module, r, forced)
        if "b" in settings and time.time() - started > budget:
            not_run(table, r, f"(b) not run: past the {budget:.0f} s budget")
        elif "b" in settings:
            add_setting(table, module, r, "(b) planner's", {})
        if json_path:
            report.save(json_path)


NOTES = [
    "published: TFLOP/s per GPU measured by Narayanan et al. (SC'21, Table 1); TFLOP/s/GPU: the predicted "
    "iteration by the paper's Eq. 3 (96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per iteration over time x GPUs); "
    "ratio = predicted / published.",
    "(a) forces Megatron's TP, PP, microbatch size (replicas take whole microbatches), full recomputation and "
    "schedule from its run_table_1.sh; (b) is the planner's own plan at fp16. Both on (GPUs/8)x8xA100-80GB, Adam.",
    "floor s: captured model FLOPs (no recomputation) over GPUs x 312 TFLOP/s; at floor: Eq. 3's TFLOP/s per GPU "
    "at that iteration, the ceiling of the column before.",
]


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "the 1.7B row only, 60 s budget")
    parser.add_argument("--rows", help=f"comma-separated row names, of {', '.join(r.name for r in ROWS)}")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds; no row or setting starts past it")
    parser.add_argument("--out", help="also write the table here, as markdown")
    parser.add_argument(
        "--settings", default="ab", help="a: Megatron's configuration, b: the planner's own plan (default both)"
    )
    args = parser.parse_args(argv)
    names = args.rows.split(",") if args.rows else ["1.7B"] if args.quick else [r.name for r in ROWS]
    by_name = {r.name.lower(): r for r in ROWS}
    unknown = [n for n in names if n.lower() not in by_name]
    if unknown:
        parser.error(f"unknown row(s) {', '.join(unknown)}; the rows are {', '.join(r.name for r in ROWS)}")
    started = time.time()
    report = Report("megatron_table", "Megatron-LM's weak-scaling table, predicted")
    report.tables.append(Table("Megatron-LM SC'21 Table 1: Megatron's configuration and the planner's", COLUMNS))
    report.tables[0].notes.extend(NOTES)
    rows = [by_name[n.lower()] for n in names]
    run_rows(rows, 60.0 if args.quick else args.budget, report, args.json, args.settings)
    report.finish(started, args.json)
    if args.out:
        Path(args.out).write_text(report.tables[0].markdown() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
