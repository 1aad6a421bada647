"""Activation memory: measured peak per rank for gpipe, 1f1b and zb-h1 as M grows, against the IR's prediction.

The MLP of `bench/bench_models.py:mlp_memory` (width 256, 8 Linear layers) is compiled for S stages
on S CPU devices with the schedule and microbatch count forced, the microbatch size held fixed (so
the global batch grows with M), SGD (no optimizer state). Then `dapple_ir.run(...)` trains it for two
steps (one process per rank through torchrun, as in production; `--transport threads` runs the ranks
as threads of one process) and reports each rank's measured peak: the bytes the runtime holds
(parameters, gradients, stored values, and the tensors autograd saved for backward, each storage once).

Prediction: `dapple_ir.analysis.peak_memory.program_peak` of each lowered rank program (what `insert-frees`
stores as `program.attrs.peak_bytes`): static bytes (parameters + gradients) plus the live
activations and received tensors at the worst instruction. The activation part of the measurement
is the measured peak minus the same static bytes, so the activation error is the total error taken
relative to the activations. Target: within 10%. Expected shapes: gpipe grows linearly with M, 1f1b
stays flat once M >= S, zb-h1 no higher than 1f1b.

What recomputation buys: the row `1f1b+recompute` lowers the same split with every stage recomputing
(`recompute = true`: the forward keeps only its inputs, the backward reruns it), so each rank holds one
microbatch's activations instead of min(S - s, M); the headline gives each rank's measured peak with
and without.

Mixed precision and sharded optimizer state (issue 44): the rows `1f1b bf16` (the same model planned with
`precision = "bf16"`: autocast's 16-bit activations and its 16-bit weight copies, one per microbatch in flight,
fp32 master weights and gradients), `1f1b zero-1 adam` (every stage over 2 replicas, `zero = 1`, Adam: each
replica holds its shard of the moments), each with its own planned split, at M = 4 (1f1b's peak is flat in M
from M = S). Target for these: the measured peak within 5% of the predicted one on every rank. The fp32 sweep
runs M = 2, 4, 16 so that the whole fits its budget in `run_all.py` (both dimensions at once, bf16 + zero-1 with
Adam, measured 0.0% on the first stage's ranks and +0.6% on the last's on 2026-12-05; not a row, for the budget).

    .venv/bin/python bench/memory.py [--quick] [--json PATH]
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from tables import Report, Table, bench_parser, median, plot_path, pyplot, save_figure, unavailable  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
#: A row's schedule with every stage recomputing its forward before the backward.
RECOMPUTE = "+recompute"
ROWS = (*SCHEDULES, "1f1b" + RECOMPUTE)
MICROBATCH_SIZE = 32


@dataclass(frozen=True)
class Plan:
    """What a row's plan is compiled with besides its schedule: precision, optimizer, replicas, sharded state."""

    precision: str = "fp32"
    optimizer: str = "sgd"
    replicas: int = 1
    """Replicas of every stage (`--data-parallel`)."""
    zero: bool = False
    """Every replicated stage shards its optimizer state (`--zero all`)."""

    def compile_options(self, stages: int) -> dict[str, Any]:
        found = {"cluster": f"{stages * self.replicas}xcpu", "optimizer": self.optimizer, "precision": self.precision}
        if self.replicas > 1:
            found |= {"data_parallel": self.replicas, "replication": "round-robin"}
        return found | ({"zero": "all"} if self.zero else {})


FP32 = Plan()
#: Rows besides the fp32 schedules: (row name, its schedule, its plan), each measured at `DIMENSION_COUNTS`.
DIMENSIONS = (
    ("1f1b bf16", "1f1b", Plan(precision="bf16")),
    ("1f1b zero-1 adam", "1f1b", Plan(optimizer="adam", replicas=2, zero=True)),
)
DIMENSION_COUNTS = (4,)


def plan_stages(module: Any, stages: int, m: int, plan: Plan = FP32) -> Any:
    """The module with the planner's stages for `stages` stages and M = `m`, kept for every run so that
    the curves over M and schedules compare the same split."""
    import dapple_ir

    result = dapple_ir.compile(
        copy.deepcopy(module), global_batch=m * MICROBATCH_SIZE, stages=stages, microbatches=m, schedule="1f1b",
        **plan.compile_options(stages),
    )  # fmt: skip
    return result.module


def measure(
    planned: Any, model_hash: str, schedule: str, m: int, work: Path, transport: str, plan: Plan = FP32, name: str = ""
) -> list[dict[str, float]]:
    """Per rank: predicted static and live bytes, and the measured peak."""
    import json

    import dapple_ir
    from dapple_ir.analysis.peak_memory import program_peak
    from dapple_ir.plan_dir import write_plan_json

    plan_dir = work / f"{(name or schedule).replace(' ', '_')}-{m}"
    module = copy.deepcopy(planned)
    module.programs = []
    # The split was planned for another M: the module's batch attributes must describe this row's.
    module.attrs.microbatches, module.attrs.global_batch = m, m * MICROBATCH_SIZE
    kind = schedule.removesuffix(RECOMPUTE)
    for stage in module.stages:
        stage.attrs.recompute = True if kind != schedule else None
    lower = f"schedule{{kind={kind},microbatches={m}}},lower-comm,insert-frees,verify"
    result = dapple_ir.compile(
        module, cluster=str(module.attrs.cluster), global_batch=m * MICROBATCH_SIZE, pipeline=lower,
        optimizer=plan.optimizer, out_dir=plan_dir,
    )  # fmt: skip
    lowered = result.module
    # compile() hashes the module it is given, and this one is already planned (its text holds layers
    # and stages); record the hash of the model as captured, which is what the runtime checks.
    meta = json.loads((plan_dir / "plan.json").read_text())
    meta["model_hash"] = model_hash
    write_plan_json(plan_dir, meta)  # reseals the plan: its digest covers plan.json
    run = dapple_ir.run(plan_dir, steps=2, transport=transport, optimizer=plan.optimizer, device="cpu")
    rows = []
    for rank, program in enumerate(lowered.programs):
        peak = program_peak(lowered, program)
        rows.append({"static": peak.static_bytes, "live": peak.live_bytes, "measured": float(run.peak_bytes[rank])})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "tiny MLP, 2 stages, M = 2")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument(
        "--transport",
        choices=("torchrun", "threads"),
        default="torchrun",
        help="torchrun: one process per rank, as in production (default); threads: every rank in this process",
    )
    args = parser.parse_args(argv)
    started = time.time()
    from dapple_ir.frontend.spec_loader import capture_spec
    from dapple_ir.ir.structure import structure_hash

    spec = f"{BENCH / 'bench_models.py'}:{'mlp_tiny' if args.quick else 'mlp_memory'}"
    module = capture_spec(spec, device="meta")
    counts = (2,) if args.quick else (2, 4, 16)
    kib = 1024.0
    table = Table(
        f"Peak memory per rank, predicted (IR) vs measured (runtime), {args.stages} stages, microbatch "
        f"{MICROBATCH_SIZE}",
        ["schedule", "M", "rank", "static KiB", "predicted act KiB", "measured act KiB", "act error",
         "predicted peak KiB", "measured peak KiB", "peak error"],
    )  # fmt: skip
    series: dict[tuple[str, int], list[tuple[int, float, float]]] = {}
    act_errors: list[float] = []
    #: The dimension rows' peak errors: (row, M, rank, error).
    peak_errors: list[tuple[str, int, int, float]] = []
    model_hash = structure_hash(module)
    report = Report("memory", "Activation memory: predicted vs measured", [table])
    planned = plan_stages(module, args.stages, counts[-1])
    split = [len(s.ops) for s in planned.stages]
    # The bf16 and zero-1 rows first: a run that a loaded machine stops at its budget still has them (--quick: the
    # fp32 schedules only, tests/test_bench_smoke.py).
    rows_run = [] if args.quick else [(name, schedule, plan, DIMENSION_COUNTS) for name, schedule, plan in DIMENSIONS]
    rows_run += [(schedule, schedule, FP32, counts) for schedule in ROWS]
    with tempfile.TemporaryDirectory(prefix="dapple-bench-mem-") as tmp:
        for name, schedule, plan, row_counts in rows_run:
            own = planned if plan == FP32 else None
            for m in row_counts:
                try:
                    own = own or plan_stages(module, args.stages, row_counts[-1], plan)
                    rows = measure(own, model_hash, schedule, m, Path(tmp), args.transport, plan, name)
                except Exception as exc:  # a schedule that does not compile or run yet is a row, not a crash
                    reason = unavailable(str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__)
                    table.add(name, m, "-", reason, *["-"] * 6)
                    continue
                for rank, r in enumerate(rows):
                    measured_act = r["measured"] - r["static"]
                    act_err = (measured_act - r["live"]) / r["live"] if r["live"] > 0 else float("nan")
                    peak_err = (r["measured"] - r["static"] - r["live"]) / (r["static"] + r["live"])
                    if plan == FP32:
                        act_errors.append(abs(act_err))
                    else:
                        peak_errors.append((name, m, rank, peak_err))
                    series.setdefault((name, rank), []).append((m, r["live"], measured_act))
                    table.add(
                        name, m, rank, r["static"] / kib, r["live"] / kib, measured_act / kib,
                        f"{100 * act_err:+.1f}%", (r["static"] + r["live"]) / kib, r["measured"] / kib,
                        f"{100 * peak_err:+.1f}%",
                    )  # fmt: skip
                if args.json:
                    report.save(args.json)  # partial results survive a hard stop
    table.notes += [
        f"one stage split for every fp32 row: the planner's for M={counts[-1]} ({split} ops per stage); only the "
        "schedule passes rerun per row.",
        "act = peak minus static bytes (parameters + gradients, + Adam's two moments: under zero-1 this replica's "
        "shard of them; SGD keeps no optimizer state); error = (measured - predicted) / predicted.",
        f"the bf16 and zero-1 rows (first): each its own plan (the planner's split for M={DIMENSION_COUNTS[-1]}); "
        "bf16: autocast, fp32 master weights and gradients; zero-1: every stage on 2 replicas (4 ranks), each "
        "holding its shard of Adam's moments.",
        f"measured by `dapple run --transport {args.transport}`, 2 steps; the runtime's meter counts every storage "
        "it holds once, autograd's saved tensors included.",
    ]
    peaks = {key: pts[-1] for key, pts in series.items()}
    bought = [
        f"rank {rank} {(peaks[('1f1b', rank)][2]) / kib:.0f} -> {peaks[('1f1b' + RECOMPUTE, rank)][2] / kib:.0f} KiB"
        for rank in range(args.stages)
        if ("1f1b", rank) in peaks and ("1f1b" + RECOMPUTE, rank) in peaks
    ]
    if bought:
        report.headlines.append(f"recomputation at M={counts[-1]}, measured activation peak: " + ", ".join(bought))
    if peak_errors:
        name, m, rank, worst_peak = max(peak_errors, key=lambda e: abs(e[3]))
        report.headlines.append(
            f"bf16 and zero-1 peak per rank: worst error {100 * worst_peak:+.1f}% ({name}, M={m}, rank {rank}; "
            f"target 5%: {'met' if abs(worst_peak) <= 0.05 else 'missed'})"
        )
    if act_errors:
        worst = max(act_errors)
        report.headlines.append(
            f"activation peak prediction: median error {100 * median(act_errors):.1f}%, worst {100 * worst:.1f}% "
            f"(target 10%: {'met' if worst <= 0.10 else 'missed'})"
        )
    return report.finish(started, args.json, _plot(series, args.stages, plot_path(args.json, "memory.png")))


def _plot(series: dict[tuple[str, int], list[tuple[int, float, float]]], stages: int, path: Path) -> str | None:
    """One panel per rank: activation peak vs M, measured (markers) and predicted (dashed) per schedule."""
    if not series:
        return None
    plt = pyplot()

    ranks = sorted({rank for schedule, rank in series if schedule in ROWS})
    fig, axes = plt.subplots(1, len(ranks), figsize=(5.5 * len(ranks), 4.2), squeeze=False)
    colors = {"gpipe": "tab:red", "1f1b": "tab:blue", "zb-h1": "tab:green", "1f1b" + RECOMPUTE: "tab:purple"}
    # Distinct markers and sizes: schedules with equal peaks (1f1b and zb-h1 often) stay visible.
    markers = {"gpipe": ("o", 6), "1f1b": ("s", 9), "zb-h1": ("^", 5), "1f1b" + RECOMPUTE: ("D", 5)}
    for ax, rank in zip(axes[0], ranks, strict=True):
        for schedule in ROWS:
            pts = series.get((schedule, rank))
            if not pts:
                continue
            ms = [p[0] for p in pts]
            ax.plot(ms, [p[1] / 2**20 for p in pts], "--", color=colors[schedule], alpha=0.7)
            marker, size = markers[schedule]
            ax.plot(ms, [p[2] / 2**20 for p in pts], "-", marker=marker, markersize=size, color=colors[schedule],
                    markerfacecolor="none" if schedule == "1f1b" else colors[schedule], label=schedule)  # fmt: skip
        ax.set_xscale("log", base=2)
        counts = sorted({p[0] for (_, r), pts in series.items() if r == rank for p in pts})
        ax.set_xticks(counts, [str(m) for m in counts])
        ax.minorticks_off()
        ax.set_xlabel("microbatches M (fixed microbatch size)")
        ax.set_ylabel("activation peak (MiB)")
        ax.set_title(f"rank {rank} of {stages}: measured (solid) vs predicted (dashed)")
        ax.grid(alpha=0.3)
        ax.legend()
    return save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
