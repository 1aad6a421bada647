"""Run every benchmark within its time budget and regenerate BENCHMARKS.md and bench/results/*.png.

Each benchmark runs as its own process with a time limit (a benchmark that overruns or fails becomes
a "not available" section that says why; the others still run). Benchmarks that write a JSON report
(`--json`) become tables; the others' printed output is included verbatim. The whole run fits in
30 minutes on a 2-core machine.

    .venv/bin/python bench/run_all.py                 # everything (`make bench`)
    .venv/bin/python bench/run_all.py --quick         # every benchmark in its quick mode
    .venv/bin/python bench/run_all.py --only memory,plan_quality --out /tmp/B.md
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from tables import Report, load_report  # noqa: E402


@dataclass(frozen=True)
class Bench:
    """One benchmark script: its budget, its arguments, and whether it writes a JSON report."""

    name: str
    budget_s: float
    args: tuple[str, ...] = ()
    quick_args: tuple[str, ...] = ("--quick",)
    json: bool = True


#: The benchmark that `--keep-runs` is for.
RUNTIME_BENCH = "runtime_vs_torch_pipelining"

# Budgets add up to 30 minutes (issue 9 allows 30; 29.9 since 2026-12-03); each is a hard limit, and a script's own
# --budget stays below it so that it finishes its table in time. runtime_vs_torch_pipelining takes the largest share:
# its 16 cases x 2 A/B pairs took 707 s alone on a quiet machine (one torchrun start per case; 404 s on 2026-12-03
# with 30-step MLP runs), and past its budget a case runs fewer pairs; plan_dimensions skips the cases past its
# budget, the large models last. On 2026-12-01 hf_startup took 100 s (124 s at most over twelve runs), planner 32 s
# and simulator_speed 18 s alone, hence their shares; capture_large took 17-39 s over twelve runs, compile_time
# 100-186 s of its 185 (each case is short: its own budget of 170 stops it in time); profile_accuracy calibrates
# once (15 s; four calibrations took it past 35 s in every run up to 2026-12-03). The runtime benchmark's MLP runs
# are 90 steps since 2026-12-03 (30 before: the measured waiting's standard error was 1-2 points a rank, as large
# as the 15 % it is compared at), about 120 s more; its budget leaves 60 s for the analysis after the last case
# before the hard limit, and it starts no case past its budget. On 2026-12-04 a VM twice as slow needed 942 s for
# its 2 pairs a case: within this budget most cases ran one pair (docs/runtime.md). Since 2026-12-04 it times the
# machine's own noise before its cases (bench/host_noise.py, about 10 s), hence 560. plan_quality's cases take up to
# 36 s (GNMT-16 on 16 V100s: 31 s of planning, 5 of ILP) and one starting just before its own 190 s runs to about
# 226 s: twice on 2026-12-02 a slower VM hit the old 210 s hard limit mid-case, hence 240.
BENCHES = (
    Bench("plan_quality", 240, ("--budget", "190")),
    Bench("plan_dimensions", 170, ("--budget", "140")),
    Bench("compile_time", 190, ("--budget", "170")),
    Bench("memory", 140),
    Bench("predicted_vs_measured", 150, ("--budget", "110")),
    Bench(RUNTIME_BENCH, 630, ("--budget", "560", "--pairs", "2")),
    Bench("capture_large", 45, ("--repeats", "2")),
    Bench("hf_startup", 130, ("--repeats", "1")),
    Bench("profile_accuracy", 25, (), (), json=False),
    Bench("simulator_speed", 30, ("--repeats", "3"), ("--repeats", "1"), json=False),
    Bench("planner", 45, (), ("--layers", "24"), json=False),
    # Megatron-LM's Table 1, Megatron's configuration (a) only, the rows that plan within the budget (1.7B-18.4B took
    # 68 s on 2026-12-05; the larger rows are named as not run): planning 1,024+ devices is too slow for more yet.
    Bench("megatron_table", 180, ("--budget", "150", "--settings", "a"), ("--quick", "--settings", "a"), json=True),
    # Llama-2-7B captured once and planned three times (fp32, bf16, bf16 + ZeRO-1): about 80 s a plan on the dev VM.
    Bench("mfu", 330, ("--budget", "250", "--cases", "7b"), ("--budget", "30", "--cases", "7b"), json=False),
)


@dataclass
class Outcome:
    bench: Bench
    seconds: float
    report: Report | None = None
    output: str = ""
    failure: str = ""
    reused_from: str = ""
    """When the section comes from stored results (`--reuse`): when they were written."""
    load: str = ""
    """1-minute load average when the benchmark ended (other processes sharing the cores)."""


def save_outcome(outcome: Outcome, results: Path) -> None:
    """What `--reuse` needs to render this benchmark again without running it."""
    data = {
        "seconds": outcome.seconds,
        "output": outcome.output,
        "failure": outcome.failure,
        "finished": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "load": outcome.load,
    }
    (results / f"{outcome.bench.name}.outcome.json").write_text(json.dumps(data))


def stored_outcome(bench: Bench, results: Path) -> Outcome:
    """The benchmark's last stored outcome (and report), for `--reuse`."""
    path = results / f"{bench.name}.outcome.json"
    if not path.is_file():
        return Outcome(bench, 0.0, failure="not available: not run, and no stored result to reuse")
    data = json.loads(path.read_text())
    json_path = results / f"{bench.name}.json"
    report = load_report(json_path) if bench.json and json_path.is_file() else None
    written = data.get("finished") or datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.UTC).strftime(
        "%Y-%m-%d %H:%M UTC"
    )
    return Outcome(
        bench, float(data["seconds"]), report, data["output"], data["failure"], written, data.get("load", "")
    )


def run_one(bench: Bench, quick: bool, results: Path, extra: tuple[str, ...] = ()) -> Outcome:
    script = BENCH / f"{bench.name}.py"
    if not script.is_file():
        return Outcome(bench, 0.0, failure=f"not available: {script.relative_to(ROOT)} does not exist")
    json_path = results / f"{bench.name}.json"
    json_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(script), *(bench.quick_args if quick else bench.args), *extra]
    if bench.json:
        cmd += ["--json", str(json_path)]
    started = time.time()
    print(f"[run_all] {bench.name}: {' '.join(cmd[1:])} (budget {bench.budget_s:.0f} s)", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=bench.budget_s)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        # Benchmarks save their JSON after every row: keep what was measured before the stop.
        partial = load_report(json_path) if bench.json and json_path.is_file() else None
        if partial is not None:
            why = f"partial: stopped at its {bench.budget_s:.0f} s budget; the rows measured before the stop follow"
        else:
            why = f"not available: over its {bench.budget_s:.0f} s budget"
        return Outcome(bench, time.time() - started, report=partial, output=out, failure=why)
    seconds = time.time() - started
    print(proc.stdout, flush=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return Outcome(bench, seconds, output=proc.stdout, failure=f"not available: exit {proc.returncode}: {tail[0]}")
    report = load_report(json_path) if bench.json and json_path.is_file() else None
    return Outcome(bench, seconds, report=report, output=proc.stdout)


def machine() -> list[tuple[str, str]]:
    cpu = platform.processor() or "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = "unknown"
    for line in Path("/proc/meminfo").read_text().splitlines() if Path("/proc/meminfo").exists() else []:
        if line.startswith("MemTotal"):
            mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "not installed"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return [
        ("CPU", cpu),
        ("cores", str(os.cpu_count())),
        ("memory", mem),
        ("torch", torch_version),
        ("python", platform.python_version()),
        ("OS", f"{platform.system()} {platform.release()}"),
        ("commit", (commit.stdout.strip() or "unknown") + " (plus the working tree's uncommitted changes)"),
    ]


def render(
    outcomes: list[Outcome], info: list[tuple[str, str]], loads: tuple[str, str] | None, quick: bool, out: Path
) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    total = sum(o.seconds for o in outcomes)
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `make bench` (`bench/run_all.py{' --quick' if quick else ''}`) on {now} in {total / 60:.1f} "
        "minutes; do not edit by hand. Every figure is a median of repeated runs, every ratio is measured "
        "within one run (the two sides interleaved A B A B); nothing here is a timed test.",
        "",
        "## Machine",
        "",
        "| | |",
        "| --- | --- |",
        *[f"| {k} | {v} |" for k, v in info],
        *([f"| load average (1 min) | {loads[0]} at start, {loads[1]} at end |"] if loads else []),
        "",
        "A load average above the core count means other processes shared the cores while these figures "
        "were taken: absolute times are then noisy, ratios measured side by side less so.",
        "",
        "## Headlines",
        "",
    ]
    for o in outcomes:
        if o.report:
            lines += [f"- **{o.bench.name}**: {h}" for h in o.report.headlines]
        if o.failure:
            lines.append(f"- **{o.bench.name}**: {o.failure}")
    for o in outcomes:
        title = o.report.title if o.report else o.bench.name.replace("_", " ")
        stored = f" Stored result of the run that ended at {o.reused_from}." if o.reused_from else ""
        load = f" Load average (1 min) at its end: {o.load}." if o.load else ""
        lines += ["", f"## {title}", "", f"`bench/{o.bench.name}.py` — {o.seconds:.0f} s.{load}{stored}", ""]
        if o.failure:
            lines += [o.failure, ""]
        if o.report:
            for table in o.report.tables:
                lines += [table.markdown(), ""]
            lines += [f"![{Path(p).stem}]({os.path.relpath(p, out.resolve().parent)})" for p in o.report.plots]
        elif o.output.strip():
            lines += ["```", o.output.strip(), "```"]
    return "\n".join(lines).rstrip() + "\n"


def load_average() -> str:
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="every benchmark in its quick mode")
    parser.add_argument("--only", help="comma-separated benchmark names (default: all)")
    parser.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"), help="markdown file to write")
    parser.add_argument("--results", default=str(BENCH / "results"), help="folder for the JSON reports")
    parser.add_argument(
        "--reuse", action="store_true", help="with --only: render the other benchmarks from their stored results"
    )
    parser.add_argument("--render-only", action="store_true", help="run nothing: render every stored result")
    parser.add_argument(
        "--keep-runs",
        help="runtime_vs_torch_pipelining stores its cases' runs here (its --keep-runs), to be analysed again with "
        "its --from-runs",
    )
    args = parser.parse_args(argv)
    chosen = set(args.only.split(",")) if args.only else None
    if args.render_only:
        chosen, args.reuse = set(), True
    unknown = (chosen or set()) - {b.name for b in BENCHES}
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    start_load = load_average()
    outcomes: list[Outcome] = []
    for bench in BENCHES:
        if chosen is None or bench.name in chosen:
            keep = ("--keep-runs", args.keep_runs) if args.keep_runs and bench.name == RUNTIME_BENCH else ()
            outcomes.append(run_one(bench, args.quick, results, keep))
            outcomes[-1].load = load_average()
            save_outcome(outcomes[-1], results)
        elif args.reuse:
            outcomes.append(stored_outcome(bench, results))
    ran = any(not o.reused_from for o in outcomes)
    text = render(outcomes, machine(), (start_load, load_average()) if ran else None, args.quick, Path(args.out))
    Path(args.out).write_text(text)
    print(f"[run_all] wrote {args.out} ({sum(o.seconds for o in outcomes) / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
