"""What each dimension of the plan space buys: the planner with everything, then without one dimension.

Issue 17 added four dimensions to the search: replicas that split each microbatch (DAPPLE's data
parallelism inside a stage), a microbatch cost with a fixed part per op call, virtual stages
(interleaved 1F1B), and per-stage activation recomputation. For published profiles and example
models, on the clusters where each dimension should matter, this plans the model with the full
search (the `plan` pass's `search`, the best candidates ranked by the simulator) and again with one
dimension taken away, and reports the simulated iteration time of each plan (lower is better) and
the full plan's gain over each: time without the dimension / time with everything (above 1: the
dimension bought that much; 1.00: the planner did not need it here).

- no split: `replication=round-robin` (a replicated stage takes whole microbatches in turn);
- no fixed cost: the search runs on the same cluster with `op_overhead = 0` (an op call's time
  scales with the microbatch all the way down, as before issue 17); its chosen plan is then lowered
  and simulated with the real per-call cost, which is what that plan would cost;
- no virtual stages: `virtual=1`;
- no recomputation: `recompute=none` ("no fit" when nothing fits without it).

Every time is the simulator's (the same lowering and network model for all columns).

    .venv/bin/python bench/plan_dimensions.py [--quick] [--json PATH] [--budget SECONDS]
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from tables import Report, Table, bench_parser, unavailable  # noqa: E402

PROFILES = ROOT / "examples" / "profiles"

#: (column, the search request's options) for each dimension taken away.
WITHOUT = (
    ("no split", {"replication": "round-robin"}),
    ("no fixed cost", {}),
    ("no virtual stages", {"virtual": 1}),
    ("no recomputation", {"recompute": "none"}),
)
SPLIT, FIXED, VIRTUAL, RECOMPUTE = (column for column, _ in WITHOUT)

VGG19 = f"profile:{PROFILES}/dapple-vgg-19-pbs-32.txt"
#: (name, model spec or profile, cluster, global batch, the dimensions taken away): each row a case
#: where some dimension may matter (each search of a large model takes up to a minute: the others
#: are left out, "-"). GNMT-16 on 2x8 V100 at 1024 (the fixed cost: 1.21x) takes over a minute per
#: search, past make bench's budget.
CASES = (
    ("VGG-19", VGG19, "2x8xV100-16GB", 32, (SPLIT, FIXED)),
    ("VGG-19", VGG19, "2x8xV100-16GB", 1024, (SPLIT, FIXED)),
    ("BERT-48", f"profile:{PROFILES}/dapple-bert-48-pbs-2.txt", "1x8xV100-16GB", 8, (SPLIT, VIRTUAL)),
    ("ResNet-18 (PipeDream)", f"profile:{PROFILES}/pipedream-resnet18.txt", "2x8xA100-80GB", 2048, (SPLIT, FIXED)),
    ("Llama-2-70B, seq 2048", f"{ROOT}/examples/llama.py:factory_70b", "8x8xH100", 64, (RECOMPUTE,)),
    ("GPT 1.5B (examples/gpt.py)", f"{ROOT}/examples/gpt.py:factory_large", "2x8xV100-16GB", 16, (VIRTUAL,)),
)
QUICK = (CASES[0],)


def coarsened(spec: str, cluster: str) -> Any:
    """The module of `spec` with costs for `cluster`, coarsened as `dapple compile` does."""
    from dapple_ir.frontend.profile_import import import_profile
    from dapple_ir.frontend.spec_loader import capture_spec
    from dapple_ir.pass_manager import PassManager, build_pipeline
    from dapple_ir.registry import PassContext

    if spec.startswith("profile:"):
        module, pipeline = import_profile(spec.removeprefix("profile:")), "coarsen"
    else:
        module, pipeline = capture_spec(spec, device="meta"), "annotate-cost,coarsen"
    PassManager(build_pipeline(pipeline)).run(module, PassContext(cluster=cluster))
    return module


def without_fixed_cost(cluster: Any) -> Any:
    """The cluster with every device kind's per-call cost set to zero."""
    kinds = tuple(dataclasses.replace(kind, op_overhead=0.0) for kind in cluster.node_kinds)
    return dataclasses.replace(cluster, node_kinds=kinds)


def one_case(spec: str, cluster_name: str, global_batch: int, dimensions: tuple[str, ...]) -> dict[str, Any]:
    from dapple_ir.cluster.toml_file import resolve_cluster
    from dapple_ir.errors import DappleError
    from dapple_ir.passes.plan import lower_and_simulate
    from dapple_ir.planner.cost_model import problem_from_module
    from dapple_ir.planner.search import Request, search

    started = time.perf_counter()
    module = coarsened(spec, cluster_name)
    cluster = resolve_cluster(cluster_name)
    problem = problem_from_module(module, cluster, global_batch)
    score = functools.partial(lower_and_simulate, module)
    full = search(problem, Request(), score)
    row: dict[str, Any] = {"plan": full.chosen.cand.describe(), "time": full.chosen.time_s}
    for column, options in WITHOUT:
        if column not in dimensions:
            continue
        try:
            if column == "no fixed cost":
                blind = problem_from_module(module, without_fixed_cost(cluster), global_batch)
                chosen = search(blind, Request(), score).chosen.cand
                # What the overhead-blind choice costs once each op call pays its fixed part.
                seconds, peak = lower_and_simulate(module, problem, chosen)
                fits = all(peak <= problem.capacity(d) for s in chosen.stages for d in s.devices)
                row[column] = seconds if fits else "no fit"
                row[column + " plan"] = chosen.describe()
            else:
                outcome = search(problem, Request(**options), score)
                row[column] = outcome.chosen.time_s
                row[column + " plan"] = outcome.chosen.cand.describe()
        except DappleError as exc:
            row[column] = "no fit" if "fit" in str(exc) else unavailable(str(exc).splitlines()[0][:100])
    row["seconds"] = time.perf_counter() - started
    return row


def _gain(row: dict[str, Any], column: str) -> Any:
    value = row.get(column)
    if isinstance(value, float) and row["time"] > 0:
        return value / row["time"]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "VGG-19 on 2x8 V100 only")
    parser.add_argument("--budget", type=float, default=400.0, help="seconds; cases past it are skipped")
    args = parser.parse_args(argv)
    started = time.time()
    times = Table(
        "Simulated iteration time (s): the full search, and without each dimension",
        ["model", "cluster", "global batch", "full", *(c for c, _ in WITHOUT), "full plan", "planning s"],
    )
    gains = Table(
        "Gain of each dimension: time without it / time with everything (1.00: not needed here)",
        ["model", "cluster", "global batch", *(c for c, _ in WITHOUT), "plans without it (where they differ)"],
    )
    report = Report("plan_dimensions", "What each plan-space dimension buys", [times, gains])
    best: dict[str, tuple[float, str]] = {}
    gains.notes = ["-: not tried for this model (the searches of the large models take up to a minute each)."]
    times.notes = [
        "times: the simulator's iteration time of each plan (s); 'no fit': no plan fits in memory without the "
        "dimension; 'no fixed cost': the plan chosen as if op calls had no fixed cost, simulated with it.",
        "plans: S stages, V virtual stages, M microbatches, schedule, placement, recomputing stages, "
        "layers[first-last x replicas] per stage (a trailing 's' where the replicas split each microbatch).",
    ]
    for name, spec, cluster, global_batch, dimensions in QUICK if args.quick else CASES:
        blank = ["-"] * (len(WITHOUT) + 2)
        if time.time() - started > args.budget:
            times.add(name, cluster, global_batch, unavailable("skipped: over the time budget"), *blank)
            continue
        try:
            row = one_case(spec, cluster, global_batch, dimensions)
        except Exception as exc:  # one model that fails must not hide the others
            times.add(name, cluster, global_batch, unavailable(str(exc).splitlines()[0][:120]), *blank)
            continue
        columns = [row.get(c, "-") for c, _ in WITHOUT]
        times.add(name, cluster, global_batch, row["time"], *columns, row["plan"], row["seconds"])
        differ = "; ".join(
            f"{c}: {row[c + ' plan']}" for c, _ in WITHOUT if row.get(c + " plan") not in (None, row["plan"])
        )
        gained = {c: _gain(row, c) for c, _ in WITHOUT if c in row}
        gains.add(name, cluster, global_batch, *(gained.get(c, "-") for c, _ in WITHOUT), differ or "-")
        print(f"{name} on {cluster}: {row['seconds']:.0f} s", file=sys.stderr)
        for column, gain in gained.items():
            where = f"{name} on {cluster}, global batch {global_batch}"
            if gain == "no fit" or (isinstance(gain, float) and gain > best.get(column, (1.0, ""))[0]):
                best[column] = (float("inf") if gain == "no fit" else float(gain), where)
        if args.json:
            report.save(args.json)  # what is done so far survives a hard stop at run_all's limit
    for column, (gain, where) in best.items():
        what = "the only plans that fit" if gain == float("inf") else f"{gain:.2f}x faster"
        report.headlines.append(f"{column.removeprefix('no ')}: {what} ({where})")
    return report.finish(started, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
