"""Time and peak memory of capturing a GPT-2 XL sized model (1.56B parameters) on the meta device.

Each method runs in a fresh process (so its peak RSS is its own), `--repeats` times, phases timed
separately: importing torch (with torch._dynamo, which meta kernels pull in), building the model on
meta, tracing + shape propagation (capture), and the per-op cost annotation (`dapple_ir.frontend.flops`).
Reports medians; nothing is asserted.

    .venv/bin/python bench/capture_large.py [--quick] [--repeats N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from tables import Report, Table, bench_parser, median, unavailable  # noqa: E402

PHASES = ("import torch", "build on meta", "capture", "cost annotation")


def one_run(method: str, factory: str) -> dict[str, Any]:
    """Runs in the child process: times each phase, reports peak RSS (ru_maxrss) at the end."""
    import resource

    times: dict[str, float] = {}
    t = time.perf_counter()
    import torch._dynamo  # noqa: F401  (torch's meta kernels import it on first use: count it here)

    times["import torch"] = time.perf_counter() - t
    from dapple_ir.frontend.flops import annotate_flops
    from dapple_ir.frontend.model_spec import FactoryResult, capture_loaded, load_model_spec

    t = time.perf_counter()
    loaded = load_model_spec(str(ROOT / "examples" / "gpt.py") + f":{factory}", device="meta")
    assert isinstance(loaded, FactoryResult)
    times["build on meta"] = time.perf_counter() - t
    t = time.perf_counter()
    captured = capture_loaded(loaded, method=method, annotate_costs=False)
    times["capture"] = time.perf_counter() - t
    rss_after_capture = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t = time.perf_counter()
    annotate_flops(captured)
    times["cost annotation"] = time.perf_counter() - t
    params = sum(p.type.numel for p in captured.module.params if not p.attrs.buffer)
    return {
        "times": times,
        "ops": len(captured.module.ops),
        "params": params,
        "rss_capture_mib": rss_after_capture,
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_fresh(method: str, factory: str, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", method, factory]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"failed": tail[0][:160]}
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "the small GPT instead of the 1.56B one")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per method (median reported)")
    parser.add_argument("--methods", default="fx,export", help="comma-separated capture methods")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per process")
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "FACTORY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one_run(*args.one)))
        return 0

    started = time.time()
    factory = "factory" if args.quick else "factory_large"
    methods = args.methods.split(",")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for _ in range(args.repeats):
        for method in methods:  # interleaved, so machine noise spreads over both methods
            runs[method].append(run_fresh(method, factory, args.timeout))
    columns = ["method", "ops", "parameters", *[f"{p} (s)" for p in PHASES], "total (s)"]
    columns += ["peak RSS after capture (MiB)", "peak RSS (MiB)"]
    table = Table(f"capture of examples/gpt.py:{factory} on meta", columns)
    for method, results in runs.items():
        good = [r for r in results if "failed" not in r]
        if not good:
            table.add(method, *[unavailable(results[0]["failed"])] * (len(table.columns) - 1))
            continue
        phase = [median([r["times"][p] for r in good]) for p in PHASES]
        table.add(
            method,
            good[0]["ops"],
            good[0]["params"],
            *[round(x, 2) for x in phase],
            round(median([sum(r["times"].values()) for r in good]), 2),
            round(median([r["rss_capture_mib"] for r in good])),
            round(median([r["rss_mib"] for r in good])),
        )
    table.notes.append(f"median of {args.repeats} fresh processes per method; peak RSS is ru_maxrss of the process")
    report = Report("capture_large", "Capturing a 1.56B-parameter GPT on the meta device", tables=[table])
    return report.finish(started, args.json)


if __name__ == "__main__":
    sys.exit(main())
