"""Plan quality: our planner vs the plans a user would pick instead, in the same simulator.

For the profiles of the models PipeDream and DAPPLE evaluated (`PAPER_PROFILES`; examples/profiles
holds more) and every example model (its large builder, captured on the meta device), on a 2x8 and a
16x1 V100-16GB cluster (DAPPLE's settings) and a 4x8 H100 cluster:

- ours: the `plan` pass's search (DP + ILP + baselines, best few ranked by the simulator), its
  simulated iteration time;
- each baseline of `dapple_ir.planner.baselines` (data parallel, uniform, parameter-balanced, time-balanced,
  PipeDream's planner), lowered with the same schedule passes and simulated the same way;
- speed-up = baseline simulated time / ours (above 1: ours is faster); "no fit" when the
  baseline's best plan does not fit in device memory;
- the ILP: CP-SAT (`planner_ilp.solve_ilp`, append-first placement) at our plan's stage
  count, microbatch count and schedule, within a time limit: the cost model's time of its best plan
  (the incumbent), its proven lower bound, and "optimal" when the two met. "ours vs ILP" compares our
  plan's cost-model estimate with that incumbent (negative: ours is better by the model, which can
  happen when the solver stopped early or our plan uses another placement policy); it is a gap to the
  optimum only where the status says "optimal";
- card floor: the bytes our plan's cuts and allreduces put on its busiest network card per
  iteration over the card's bandwidth (`dapple_ir.pricing.traffic`): no iteration is shorter;
- 15+1: for VGG-19 on the V100 clusters, the plan issue 16 names (the convolutions data parallel on
  15 devices, the classifier on the 16th), simulated at its best microbatch count.

    .venv/bin/python bench/plan_quality.py [--quick] [--json PATH] [--budget SECONDS]
"""

from __future__ import annotations

import copy
import functools
import math
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from tables import Report, Table, bench_parser, median, plot_path, pyplot, save_figure, unavailable  # noqa: E402

PROFILES = ROOT / "examples" / "profiles"
CLUSTERS = ("2x8xV100-16GB", "16x1xV100-16GB", "4x8xH100")
EXAMPLES = ("mlp", "gpt", "cnn", "kwargs_dict", "control_flow")
#: Speed-ups above this are drawn clipped, with their value written above the bar.
CLIP = 8.0
BASELINE_NAMES = ("data-parallel", "uniform", "parameter-balanced", "time-balanced", "pipedream")


#: The models of PipeDream's and DAPPLE's evaluations (DAPPLE's GNMT-16, BERT-48, XLNet-36,
#: AmoebaNet-36 and VGG-19; PipeDream's VGG-16, ResNet-18 and GNMT); the other files are variants.
PAPER_PROFILES = (
    "dapple-amoeba-36-pbs-1",
    "dapple-bert-48-pbs-2",
    "dapple-gnmt-16-pbs-64",
    "dapple-vgg-19-pbs-32",
    "dapple-xlnet-36-pbs-1",
    "pipedream-gnmt",
    "pipedream-resnet18",
    "pipedream-vgg16",
)


def profile_files() -> list[Path]:
    return sorted(p for p in PROFILES.glob("*.txt") if p.stem in PAPER_PROFILES)


def load_models(quick: bool) -> list[tuple[str, Any, int]]:
    """(name, module before costs, global batch) for every model."""
    from dapple_ir.frontend.profile_import import import_profile

    models: list[tuple[str, Any, int]] = []
    files = profile_files()
    # Quick: VGG-19 alone (26 layers: the auto search skips its ILP stage, so it plans in seconds).
    for f in [f for f in files if "vgg-19" in f.name][:1] if quick else files:
        module = import_profile(str(f))
        # Two samples per device and DAPPLE's 16 devices: a global batch where pipelining matters.
        models.append((f.stem, module, 32 * int(module.attrs.batch or 1)))
    from dapple_ir.frontend.spec_loader import capture_spec

    for name in () if quick else EXAMPLES:
        spec = f"examples/{name}.py:{'factory' if quick else 'factory_large'}"
        try:
            module = capture_spec(str(ROOT / spec), device="meta")
        except Exception as exc:  # one model that no longer captures must not hide the others
            models.append((f"{name} (capture failed: {str(exc).splitlines()[0][:80]})", None, 0))
            continue
        models.append((f"examples/{name}", module, 16 * int(module.attrs.batch or 1)))
    return models


def ilp_solution(problem: Any, stages: int, microbatches: int, schedule: str, time_limit_s: float) -> Any:
    """CP-SAT's incumbent and proven bound at this stage and microbatch count (None: no solution)."""
    from dapple_ir.planner.ilp import solve_ilp

    return solve_ilp(problem, stages, microbatches, schedule, time_limit_s)


def one_case(module: Any, global_batch: int, cluster_name: str, ilp_s: float) -> dict[str, Any]:
    from dapple_ir.cluster.toml_file import resolve_cluster
    from dapple_ir.pass_manager import PassManager, build_pipeline
    from dapple_ir.passes.plan import lower_and_simulate
    from dapple_ir.planner.baselines import all_baselines
    from dapple_ir.planner.cost_model import problem_from_module
    from dapple_ir.planner.search import Request, search
    from dapple_ir.registry import PassContext

    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[phase] = now - clock
        clock = now

    base = copy.deepcopy(module)
    base.attrs.global_batch = global_batch
    front = "coarsen" if base.attrs.capture_method == "profile" else "annotate-cost,coarsen"
    PassManager(build_pipeline(front)).run(base, PassContext(cluster=cluster_name, log=lambda _m: None))
    cluster = resolve_cluster(cluster_name)
    problem = problem_from_module(base, cluster, global_batch)
    lap("front")
    # `search` lowers every candidate on a copy of its own: `base` stays unplanned for the baselines.
    outcome = search(problem, Request(), functools.partial(lower_and_simulate, base))
    lap("plan")
    plan_s = timings["plan"]
    chosen = outcome.chosen
    result: dict[str, Any] = {
        "layers": problem.layers,
        "plan": _describe(chosen.cand),
        "ours_s": chosen.time_s,
        "ours_est": chosen.estimate.iteration_s,
        "floor_s": chosen.estimate.floor_s,
        "plan_s": plan_s,
        "baselines": {},
        "fifteen_one_s": _fifteen_one(base, problem),
    }
    # The search ranks every fitting baseline in the simulator: reuse those times rather than lower
    # and simulate the same plans again (a plan equal to one the search kept has the same programs).
    simulated = {
        (s.cand.stages, s.cand.microbatches, s.cand.schedule): s.simulated_s
        for s in outcome.considered
        if s.simulated_s is not None
    }
    found = all_baselines(problem)
    for name in BASELINE_NAMES:
        if name not in found:
            result["baselines"][name] = "none"
            continue
        cand, est = found[name]
        if not est.fits:
            result["baselines"][name] = "no fit"
            continue
        known = simulated.get((cand.stages, cand.microbatches, cand.schedule))
        result["baselines"][name] = known if known is not None else lower_and_simulate(base, problem, cand)[0]
    lap("baselines")
    shape = (len(chosen.cand.stages), chosen.cand.microbatches, chosen.cand.schedule)
    result["ilp"] = ilp_solution(problem, *shape, ilp_s)
    lap("ilp")
    result["timings"] = timings
    return result


def _fifteen_one(module: Any, problem: Any) -> float | str:
    """VGG-19's convolutions on 15 devices and its classifier (from FC1 on) on the 16th, simulated at
    its best microbatch count; '-' for other models and clusters."""
    from dapple_ir.passes.plan import lower_and_simulate
    from dapple_ir.planner.cost_model import Candidate, StageChoice, evaluate

    targets = [[op.target for op in layer.ops] for layer in module.layers]
    if problem.cluster.num_devices != 16 or "vgg-19" not in module.name.replace("_", "-"):
        return "-"
    tail = next((k for k, names in enumerate(targets) if "node23" in names), None)
    if tail is None:
        return "-"
    stages = (StageChoice(0, tail, tuple(range(15))), StageChoice(tail, problem.layers, (15,)))
    options = [Candidate(stages, m) for m in (64, 128, 256, 512) if problem.global_batch % m == 0]
    options = [c for c in options if evaluate(problem, c).fits]
    return min((lower_and_simulate(module, problem, c)[0] for c in options), default="no fit")


def _describe(cand: Any) -> str:
    """`S=4 R=8,4,3,1 M=128` (`R=2 each` when every stage has as many; an `s` marks a stage that splits
    each microbatch over its replicas, `R=15s,1`)."""
    replicas = cand.replication().split(",")
    shown = f"{replicas[0]} each" if len(set(replicas)) == 1 else ",".join(replicas)
    return f"S={len(replicas)} R={shown} M={cand.microbatches}"


def _ratio(baseline: Any, ours: float) -> float | str:
    return baseline / ours if isinstance(baseline, float) else baseline


COLUMNS = ["model", "cluster", "layers", "our plan", "ours s", "card floor s", *BASELINE_NAMES, "15+1 s",
           "ILP best s", "ILP bound s", "ILP status", "ours vs ILP", "plan s"]  # fmt: skip


def _ilp_cells(ilp: Any, ours_est: float) -> tuple[list[Any], float | None]:
    """Cells for the incumbent, bound, status and our plan's relative difference to the incumbent."""
    if ilp is None:
        return ["no solution", "-", "no solution in the limit", "-"], None
    diff = ours_est / ilp.estimate.iteration_s - 1
    status = "optimal" if ilp.optimal else f"open (gap {100 * ilp.gap:.1f}%)"
    if not ilp.optimal and not ilp.floor and ilp.gap == 0.0:
        status = "optimal without the card floor"
    return [ilp.estimate.iteration_s, ilp.bound_s, status, f"{100 * diff:+.1f}%"], diff


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "one profile on one cluster, no example capture")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds; cases not reached are marked")
    parser.add_argument("--ilp-seconds", type=float, default=5.0, help="CP-SAT time limit per case for the ILP")
    args = parser.parse_args(argv)
    started = time.time()
    models = load_models(args.quick)
    print(f"models loaded in {time.time() - started:.1f} s", file=sys.stderr)
    clusters = CLUSTERS[:1] if args.quick else CLUSTERS
    table = Table("Plan quality: speed-up of our plan over each baseline (baseline simulated time / ours)", COLUMNS)
    report = Report("plan_quality", "Plan quality vs baselines", [table])
    ratios: dict[str, list[float]] = {b: [] for b in BASELINE_NAMES}
    proved: list[float] = []
    open_diffs: list[float] = []
    unsolved = 0

    def skip_row(name: str, cluster: str, why: str) -> None:
        table.add(name, cluster, *["-"] * 4, *[why] * len(BASELINE_NAMES), *["-"] * 6)

    # Cluster-major order: when the budget runs out, every model has its 2x8 V100 row.
    for cluster in clusters:
        for name, module, gb in models:
            if module is None:
                skip_row(name, cluster, unavailable("model did not capture"))
                continue
            if time.time() - started > args.budget:
                skip_row(name, cluster, "not run: budget spent")
                continue
            case_started = time.time()
            try:
                r = one_case(module, gb, cluster, args.ilp_seconds)
            except Exception as exc:  # a planner error on one case is a finding, not a crash
                table.add(name, cluster, "-", unavailable(str(exc).splitlines()[0][:100]), *["-"] * (len(COLUMNS) - 4))
                print(f"{name} on {cluster}: failed after {time.time() - case_started:.1f} s", file=sys.stderr)
                continue
            phases = ", ".join(f"{k} {v:.1f}" for k, v in r["timings"].items())
            print(f"{name} on {cluster}: {time.time() - case_started:.1f} s ({phases})", file=sys.stderr)
            cells = [_ratio(r["baselines"][b], r["ours_s"]) for b in BASELINE_NAMES]
            for b, c in zip(BASELINE_NAMES, cells, strict=True):
                if isinstance(c, float):
                    ratios[b].append(c)
            ilp_cells, diff = _ilp_cells(r["ilp"], r["ours_est"])
            if diff is None:
                unsolved += 1
            elif r["ilp"].optimal:
                proved.append(diff)
            else:
                open_diffs.append(diff)
            table.add(
                name,
                cluster,
                r["layers"],
                r["plan"],
                r["ours_s"],
                r["floor_s"],
                *cells,
                r["fifteen_one_s"],
                *ilp_cells,
                r["plan_s"],
            )
            if args.json:
                report.save(args.json)  # partial results survive a hard stop
    table.notes += [
        "global batch: 32 x the profile batch for profiles, 16 x the example batch for examples; Adam memory model.",
        "clusters: the shorthand's machines (docs/cluster.md): DAPPLE's V100 servers with one 25 Gbit/s card each, "
        "DGX H100 with one 400 Gbit/s card per GPU; transfers and allreduces share the links they cross.",
        "card floor s: our plan's busiest network card, bytes per iteration / bandwidth (0 on one node or without "
        "traffic between nodes). 15+1 s: VGG-19's convolutions on 15 devices and classifier on the 16th.",
        "ours = the plan pass's search (dapple_ir.planner.search.search), which also considers the baselines; "
        "every time is the simulator's, for plans lowered by the same schedule/lower-comm/insert-frees passes.",
        f"ILP: CP-SAT over append-first placements at our plan's stages, microbatches and schedule, "
        f"{args.ilp_seconds:g} s limit. 'ILP best s' is the cost model's time of the best plan it found, 'ILP bound s' "
        "the lower bound it proved; status 'optimal' when they meet, else 'open' with the solver's own gap.",
        "ours vs ILP: our plan's cost-model estimate relative to the ILP's best plan (negative: ours is better by "
        "the model). Against an optimal ILP a negative value means our plan uses another placement policy; a positive "
        "one that the plan the simulator preferred is slower by the cost model. Against an open ILP it compares two "
        "plans, not a plan with the optimum.",
    ]
    summary = Table("Median and worst speed-up over each baseline", ["baseline", "cases", "median", "worst", "best"])
    for b in BASELINE_NAMES:
        rs = ratios[b]
        summary.add(b, len(rs), median(rs), min(rs, default=math.nan), max(rs, default=math.nan))
    report.tables.append(summary)
    for b in BASELINE_NAMES:
        if ratios[b]:
            report.headlines.append(
                f"vs {b}: median {median(ratios[b]):.2f}x, worst {min(ratios[b]):.2f}x over {len(ratios[b])} cases"
            )
    if proved:
        report.headlines.append(
            f"where CP-SAT proved the ILP optimum ({len(proved)} cases), our plan's cost-model estimate is "
            f"{100 * median(proved):+.1f}% from it at the median, {100 * max(proved):+.1f}% at worst"
        )
    if open_diffs or unsolved:
        better = sum(1 for d in open_diffs if d < 0)
        report.headlines.append(
            f"where CP-SAT stopped at the {args.ilp_seconds:g} s limit ({len(open_diffs)} cases; no proof of "
            f"optimality), our plan vs its best plan by the cost model: median {100 * median(open_diffs):+.1f}%, "
            f"ours better in {better}; {unsolved} case(s) without any ILP solution"
            if open_diffs
            else f"{unsolved} case(s) without any ILP solution within {args.ilp_seconds:g} s"
        )
    return report.finish(started, args.json, _plot(table, plot_path(args.json, "plan_quality.png")))


def _plot(table: Table, path: Path) -> str | None:
    """Grouped bars per cluster: speed-up over each baseline, one group per model; 1.0 marked."""
    plt = pyplot()

    clusters = list(dict.fromkeys(str(r[1]) for r in table.rows))
    if not clusters:
        return None
    first = table.columns.index(BASELINE_NAMES[0])
    fig, axes = plt.subplots(len(clusters), 1, figsize=(13, 3.6 * len(clusters)), squeeze=False)
    width = 0.8 / len(BASELINE_NAMES)
    for ax, cluster in zip(axes[:, 0], clusters, strict=True):
        rows = [r for r in table.rows if r[1] == cluster]
        labels = [str(r[0]).replace("examples/", "ex:") for r in rows]
        for k, b in enumerate(BASELINE_NAMES):
            values = [r[first + k] if isinstance(r[first + k], float) else 0.0 for r in rows]
            xs = [i + (k - len(BASELINE_NAMES) / 2 + 0.5) * width for i in range(len(rows))]
            # Outliers are clipped at CLIP so that the other bars stay readable; their value is written on top.
            ax.bar(xs, [min(v, CLIP) for v in values], width, label=b, color=f"C{k}")
            for x, r, v in zip(xs, rows, values, strict=True):
                if r[first + k] == "no fit":
                    ax.text(x, 0.05, "OOM", rotation=90, ha="center", va="bottom", fontsize=6)
                if v > CLIP:
                    ax.text(x, CLIP, f"{v:.0f}x", ha="center", va="bottom", fontsize=7)
        for i, r in enumerate(rows):
            if not any(isinstance(r[first + k], float) for k in range(len(BASELINE_NAMES))):
                ax.text(i, 0.5, "no plan / not run", ha="center", va="bottom", fontsize=7, rotation=90, color="gray")
        ax.set_ylim(0, CLIP * 1.12)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, rotation=15, fontsize=8)
        ax.set_ylabel("speed-up of ours (x)")
        ax.set_title(f"{cluster}: baseline time / our time (above 1 = ours faster; OOM = baseline does not fit)")
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(ncol=len(BASELINE_NAMES), fontsize=8, loc="upper right")
    return save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
