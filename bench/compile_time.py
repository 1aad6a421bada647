"""Compile time and memory: capture + plan + lower + emit of GPT-style models on clusters of many sizes.

Each (layers, devices) configuration runs in a fresh Python process, so that its peak RSS is its own
(`ru_maxrss` of that process, torch included). Phases:

- capture: `examples/gpt.py`'s GPT-2 XL-sized builder with `n_layer` set, on the meta device;
- plan: `tensor-parallel,annotate-cost,coarsen,plan` (the default planner, tensor-parallel degrees searched) for
  the cluster;
- lower: `schedule{kind=<the plan's>},lower-comm,insert-frees,verify`;
- emit: print the IR text and generate every rank's `rank_<r>.py` into a temporary directory.

The pass manager verifies the IR after every pass, as `dapple compile` does. The growth of the total
time with layers (at fixed devices) and with devices (at fixed layers) is fitted as t ~ n^k.

    .venv/bin/python bench/compile_time.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from tables import Report, Table, bench_parser, fit_exponent, plot_path, pyplot, save_figure, unavailable  # noqa: E402

PHASES = ("capture", "plan", "lower", "emit")
GLOBAL_BATCH = 1024


def cluster_for(devices: int, kind: str = "A100-80GB") -> str:
    """Nodes of 8 devices (one node of `devices` below 8)."""
    return f"1x{devices}x{kind}" if devices < 8 else f"{devices // 8}x8x{kind}"


def one_config(layers: int, devices: int, quick: bool) -> dict[str, Any]:
    """Compile one configuration in this process; seconds per phase, or the phase that failed and why."""
    import dataclasses

    t0 = time.perf_counter()
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    import gpt  # type: ignore[import-not-found]

    from dapple_ir.frontend.capture import capture
    from dapple_ir.ir.printer import print_module
    from dapple_ir.pass_manager import PassManager, build_pipeline
    from dapple_ir.registry import PassContext

    result: dict[str, Any] = {"layers": layers, "devices": devices, "import_s": time.perf_counter() - t0}
    cfg = gpt.GPTConfig(vocab=96, seq=16, d_model=32, n_layer=layers, n_head=4, batch=8) if quick else None
    cfg = cfg or dataclasses.replace(gpt.LARGE, n_layer=layers)
    ctx = PassContext(cluster=cluster_for(devices), log=lambda _m: None)
    phase = "capture"
    try:
        t = time.perf_counter()
        with torch.device("meta"):
            model, inputs, loss_fn, targets = gpt.build(cfg)
        module = capture(model, inputs, loss_fn=loss_fn, example_targets=targets).module
        module.attrs.global_batch = GLOBAL_BATCH
        result["capture"] = time.perf_counter() - t
        result["ops"] = len(module.ops)

        phase = "plan"
        t = time.perf_counter()
        PassManager(build_pipeline("tensor-parallel,annotate-cost,coarsen,plan")).run(module, ctx)
        result["plan"] = time.perf_counter() - t
        result["stages"] = len(module.stages)
        result["replicas"] = max((s.replicas for s in module.stages), default=0)

        phase = "lower"
        t = time.perf_counter()
        kind = module.attrs.schedule or "1f1b"
        PassManager(build_pipeline(f"schedule{{kind={kind}}},lower-comm,insert-frees,verify")).run(module, ctx)
        result["lower"] = time.perf_counter() - t
        result["ranks"] = len(module.programs)
        result["instrs"] = sum(len(p.instrs) for p in module.programs)

        phase = "emit"
        t = time.perf_counter()
        from dapple_ir.backends.torch.codegen import emit_rank_programs

        with tempfile.TemporaryDirectory() as out:
            (Path(out) / "plan.dapple").write_text(print_module(module))
            emit_rank_programs(module, out)
        result["emit"] = time.perf_counter() - t
    except Exception as exc:  # report which phase is missing or broken; the table says so
        result["failed"] = f"{phase}: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    result["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def run_fresh(layers: int, devices: int, quick: bool, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", str(layers), str(devices)]
    if quick:
        cmd.append("--quick")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"layers": layers, "devices": devices, "failed": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"layers": layers, "devices": devices, "failed": f"process failed: {tail[0][:160]}"}
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def build_report(
    results: list[dict[str, Any]], layer_counts: tuple[int, ...], device_counts: tuple[int, ...]
) -> tuple[Report, list[dict[str, Any]]]:
    """The tables for the configurations measured so far; also the rows where every phase ran."""
    results = sorted(results, key=lambda r: (r["layers"], r["devices"]))
    table = Table(
        "Compile time per phase (seconds) and peak RSS, GPT-2 XL-width models on A100-80GB clusters",
        ["layers", "devices", "ops", "stages x replicas", "ranks", "capture s", "plan s", "lower s", "emit s",
         "total s", "peak RSS MiB"],
    )  # fmt: skip
    for r in results:
        if "failed" in r and "capture" not in r:
            table.add(r["layers"], r["devices"], unavailable(r["failed"]), *["-"] * 8)
            continue
        failed_phase = r.get("failed", "").split(":")[0]
        cells = [r[p] if p in r else unavailable(r["failed"]) if p == failed_phase else "-" for p in PHASES]
        total = sum(r[p] for p in PHASES) if all(p in r for p in PHASES) else None
        shape = f"{r['stages']} x {r['replicas']}" if "stages" in r else "-"
        table.add(r["layers"], r["devices"], r.get("ops"), shape, r.get("ranks", "-"), *cells, total, r["maxrss_mib"])
    table.notes.append(
        f"global batch {GLOBAL_BATCH}; one fresh process per row (RSS includes torch, ~300 MiB); the pass manager "
        "verifies after every pass; capture is on the meta device."
    )
    growth = Table("Growth of compile time: t ~ n^k", ["held fixed", "varied", "k (total)", "k (plan)", "k (lower)"])
    done = [r for r in results if all(p in r for p in PHASES)]

    def exponent(rows: list[dict[str, Any]], key: str, phases: tuple[str, ...]) -> float:
        return fit_exponent([r[key] for r in rows], [sum(r[p] for p in phases) for r in rows])

    for d in device_counts:
        rows = [r for r in done if r["devices"] == d]
        growth.add(f"{d} devices", "layers", exponent(rows, "layers", PHASES), exponent(rows, "layers", ("plan",)),
                   exponent(rows, "layers", ("lower",)))  # fmt: skip
    for layer in layer_counts:
        rows = [r for r in done if r["layers"] == layer]
        growth.add(f"{layer} layers", "devices", exponent(rows, "devices", PHASES),
                   exponent(rows, "devices", ("plan",)), exponent(rows, "devices", ("lower",)))  # fmt: skip
    growth.notes.append("least-squares slope of log t against log n over the rows above (nan: fewer than 2 rows).")
    report = Report("compile_time", "Compile time and memory", [table, growth])
    biggest = [r for r in done if r["layers"] == max(layer_counts)]
    if biggest:
        worst = max(biggest, key=lambda r: r["devices"])
        total = sum(worst[p] for p in PHASES)
        report.headlines.append(
            f"{worst['layers']}-layer GPT on {worst['devices']} devices compiles in {total:.1f} s "
            f"(plan {worst['plan']:.1f} s), peak RSS {worst['maxrss_mib']:.0f} MiB"
        )
    return report, done


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "a tiny 2-layer GPT on 8 devices")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds for the whole benchmark")
    parser.add_argument("--one", nargs=2, type=int, metavar=("LAYERS", "DEVICES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one_config(args.one[0], args.one[1], args.quick)))
        return 0

    started = time.time()
    layer_counts = (2,) if args.quick else (12, 24, 48, 96)
    device_counts = (8,) if args.quick else (8, 64, 512, 1024)
    results: list[dict[str, Any]] = []
    # The headline (the largest model on the largest cluster) first, then the cheapest first, so that a
    # spent budget loses the fewest rows; the table is sorted back by (layers, devices).
    grid = sorted(((layer, d) for layer in layer_counts for d in device_counts), key=lambda c: (c[1], c[0]))
    configs = list(dict.fromkeys([(layer_counts[-1], device_counts[-1]), *grid]))
    for layer, d in configs:
        left = args.budget - (time.time() - started)
        if left < 10:
            results.append({"layers": layer, "devices": d, "failed": "skipped: benchmark budget spent"})
            continue
        # The headline row may take what it needs; later rows at most what is left.
        share = min(left, 240.0)
        results.append(run_fresh(layer, d, args.quick, share))
        if args.json:  # what is done so far survives a hard stop at run_all's limit
            build_report(results, layer_counts, device_counts)[0].save(args.json)

    report, done = build_report(results, layer_counts, device_counts)
    return report.finish(started, args.json, _plot(done, plot_path(args.json, "compile_time.png")))


def _plot(done: list[dict[str, Any]], path: Path) -> str | None:
    """Total compile time against layers, one line per cluster size, phases stacked as shaded areas."""
    if not done:
        return None
    plt = pyplot()

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for d in sorted({r["devices"] for r in done}):
        rows = sorted((r for r in done if r["devices"] == d), key=lambda r: r["layers"])
        left.plot([r["layers"] for r in rows], [sum(r[p] for p in PHASES) for r in rows], "o-", label=f"{d} devices")
        right.plot([r["layers"] for r in rows], [r["maxrss_mib"] for r in rows], "o-", label=f"{d} devices")
    for ax, label in ((left, "compile time, all phases (s)"), (right, "peak RSS of the process (MiB)")):
        ax.set_xscale("log", base=2)
        layers = sorted({r["layers"] for r in done})
        ax.set_xticks(layers, [str(x) for x in layers])
        ax.minorticks_off()
        ax.set_xlabel("GPT layers (d_model 1600)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    left.set_yscale("log")
    left.set_title("capture + plan + lower + emit")
    right.set_title("memory of the whole compile (torch included)")
    return save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
