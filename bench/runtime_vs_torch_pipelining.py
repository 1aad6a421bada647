"""Our runtime vs `torch.distributed.pipelining`: same model, same stage split, same schedule, CPU + gloo.

For each (processes, schedule) the two sides alternate A B A B ...: ours is `dapple compile` of
`bench/bench_models.py:mlp_bench` (forced stage count, schedule and microbatch count, no
replication) run by the worker that `dapple run` launches through torchrun; theirs is the same
`nn.Sequential` (same seed, same data), cut at the very layers our plan cut, wrapped in
`PipelineStage` and driven by `ScheduleGPipe` / `Schedule1F1B`, launched by the same torchrun.

Per run: every rank records each step's wall-clock start and end; a step's time is the gap between
the last rank finishing it and the last rank finishing the step before, and the run's figure is the
median over the steps after warm-up. samples/s = global batch / that median. The ratio is taken
per pair (A, B adjacent in time) and the table shows the median ratio. Memory per rank: peak bytes
of tensors held (parameters, gradients, optimizer state, saved activations, stored values: our
runtime's own meter; on the torch side the same categories through `saved_tensors_hooks`) and the
peak RSS of the rank process.

    .venv/bin/python bench/runtime_vs_torch_pipelining.py            # full
    .venv/bin/python bench/runtime_vs_torch_pipelining.py --quick    # seconds, tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from tables import Report, Table, bench_parser, median, plot_path, pyplot, save_figure, unavailable  # noqa: E402

SPEC = {"tiny": "bench/bench_models.py:mlp_tiny", "bench": "bench/bench_models.py:mlp_bench"}


@dataclass(frozen=True)
class Config:
    """One side-by-side case."""

    size: str
    procs: int
    schedule: str
    microbatches: int
    global_batch: int
    steps: int
    warmup: int
    seed: int = 0
    lr: float = 0.01
    timeout: float = 120.0


# ----------------------------------------------------------------------------- torch side (rank)


class _Saved:
    """A tensor autograd saved for backward; its finalizer tells the meter when autograd let go."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor


class HeldMeter:
    """Peak bytes of parameters, gradients, optimizer state and saved activations, each storage once."""

    def __init__(self, params: list[Any], optimizer: Any) -> None:
        self.params = params
        self.optimizer = optimizer
        self.saved: dict[int, list[int]] = {}  # storage address -> [bytes, live references]
        self.peak = 0

    def pack(self, t: Any) -> _Saved:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        entry = self.saved.setdefault(ptr, [storage.nbytes(), 0])
        entry[1] += 1
        box = _Saved(t)
        weakref.finalize(box, self._drop, ptr)
        self.sample()
        return box

    def unpack(self, box: _Saved) -> Any:
        self.sample()
        return box.tensor

    def _drop(self, ptr: int) -> None:
        entry = self.saved.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self.saved[ptr]

    def sample(self) -> None:
        seen: dict[int, int] = {ptr: e[0] for ptr, e in self.saved.items()}
        tensors = [*self.params, *(p.grad for p in self.params)]
        states = self.optimizer.state.values() if self.optimizer is not None else []
        tensors += [t for state in states for t in state.values()]
        for t in tensors:
            if t is not None and hasattr(t, "untyped_storage"):
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
        self.peak = max(self.peak, sum(seen.values()))


def torch_rank(cfg: Config, split: list[list[int]], out_dir: Path) -> None:
    """One rank of the torch.distributed.pipelining side (runs under torchrun)."""
    import datetime

    import torch
    import torch.distributed as dist
    from bench_models import build_mlp
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from dapple_ir.backends.torch.data import synthetic_batch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.timeout))
    # The same seed before the same factory as our runtime: identical initial weights.
    torch.manual_seed(cfg.seed)
    model, inputs, loss_fn, targets = build_mlp(cfg.size)
    layers = list(model)
    sub = nn.Sequential(*[layers[i] for i in split[rank]])
    del model, layers
    stage = PipelineStage(sub, rank, world, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[cfg.schedule]
    schedule = kind(stage, n_microbatches=cfg.microbatches, loss_fn=loss_fn)
    params = list(sub.parameters())
    # A stage may hold only the loss (the planner's cut for a tiny model): nothing to optimise there.
    optimizer = torch.optim.SGD(params, lr=cfg.lr, foreach=False) if params else None
    meter = HeldMeter(params, optimizer)
    step_times: dict[str, list[float]] = {}
    losses: dict[str, dict[str, float]] = {}
    for step in range(cfg.steps):
        (x,), (y,) = synthetic_batch(inputs, targets, cfg.global_batch, cfg.seed, step)
        mb_losses: list[Any] = []
        start = time.time()
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y, losses=mb_losses)
            else:
                schedule.step()
        if optimizer is not None:
            optimizer.step()
            meter.sample()
            optimizer.zero_grad(set_to_none=True)
        step_times[str(step)] = [start, time.time()]
        losses[str(step)] = {str(m): float(v) for m, v in enumerate(mb_losses)}
    dist.barrier()
    dist.destroy_process_group()
    report = {"rank": rank, "step_times": step_times, "peak_bytes": meter.peak, "losses": losses}
    _write_rank(out_dir, rank, report)


def _write_rank(out_dir: Path, rank: int, report: dict[str, Any]) -> None:
    report["maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (out_dir / f"bench_rank_{rank}.json").write_text(json.dumps(report))


# ----------------------------------------------------------------------------- our side (rank)


def dapple_rank(cfg: Config, plan_dir: Path, out_dir: Path) -> None:
    """One rank of our runtime: the worker `dapple run` launches, plus the peak RSS of this process."""
    import torch

    from dapple_ir.backends.torch import worker

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    options = worker.RunOptions(
        steps=cfg.steps, optimizer="sgd", lr=cfg.lr, timeout=cfg.timeout, run_dir=str(out_dir), device="cpu"
    )
    # The very flags `dapple run` gives the worker it launches.
    code = worker.main([str(plan_dir), *worker.worker_flags(options)])
    if code != 0:
        raise SystemExit(code)
    report = json.loads((out_dir / f"rank_{rank}.json").read_text())
    _write_rank(out_dir, rank, {k: report[k] for k in ("rank", "step_times", "peak_bytes", "losses")})


# ----------------------------------------------------------------------------- driver


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(side: str, cfg: Config, extra: dict[str, Any], work: Path) -> list[dict[str, Any]]:
    """Run one side under torchrun on 127.0.0.1; the per-rank reports, in rank order."""
    out_dir = Path(tempfile.mkdtemp(prefix=f"{side}-", dir=work))
    payload = json.dumps({"cfg": asdict(cfg), **extra})
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.procs}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        str(Path(__file__).resolve()), "--rank-worker", side, "--payload", payload, "--out", str(out_dir),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{BENCH}{os.pathsep}{ROOT}"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=cfg.timeout + 120)
    if proc.returncode != 0:
        # Our worker writes error_rank_<r>.json; otherwise the first exception line any rank printed.
        reports = sorted(out_dir.glob("error_rank_*.json"))
        if reports:
            raise RuntimeError(f"{side} run failed: {json.loads(reports[0].read_text())['message']}")
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        errors = [ln for ln in lines if re.search(r"\w+(Error|Exception)\b:", ln) and "ChildFailedError" not in ln]
        raise RuntimeError(
            f"{side} run failed ({proc.returncode}): " + (errors[0] if errors else " | ".join(lines[-3:]))
        )
    return [json.loads((out_dir / f"bench_rank_{r}.json").read_text()) for r in range(cfg.procs)]


def step_seconds(reports: list[dict[str, Any]], warmup: int) -> float:
    """Median over steps after warm-up of (last rank done with step k) - (last rank done with step k-1)."""
    steps = sorted(int(k) for k in reports[0]["step_times"])
    ends = [max(float(r["step_times"][str(k)][1]) for r in reports) for k in steps]
    gaps = [ends[i] - ends[i - 1] for i in range(max(1, warmup), len(ends))]
    return median(gaps)


def first_loss(reports: list[dict[str, Any]]) -> float:
    """Mean microbatch loss of step 0, from the rank that computed it."""
    for r in reports:
        mbs = r.get("losses", {}).get("0", {})
        if mbs:
            return sum(float(v) for v in mbs.values()) / len(mbs)
    return float("nan")


def compile_plan(cfg: Config, plan_dir: Path) -> list[list[int]]:
    """`dapple compile` with stages, schedule and microbatches forced; the Sequential indices of each stage."""
    cmd = [
        str(ROOT / ".venv" / "bin" / "dapple"), "compile", SPEC[cfg.size], "--cluster", f"{cfg.procs}xcpu",
        "--global-batch", str(cfg.global_batch), "--stages", str(cfg.procs), "--microbatches",
        str(cfg.microbatches), "--schedule", cfg.schedule, "--optimizer", "sgd", "-o", str(plan_dir),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"dapple compile failed: {(proc.stderr or proc.stdout).strip()[-400:]}")
    return stage_split(plan_dir)


def stage_split(plan_dir: Path) -> list[list[int]]:
    """Which `nn.Sequential` children each stage of the plan holds, read from the ops' module paths."""
    from dapple_ir.ir.parser import parse_module

    module = parse_module((plan_dir / "plan.dapple").read_text(), str(plan_dir / "plan.dapple"))
    split: list[list[int]] = []
    for stage in module.stages:
        if stage.replicas != 1:
            raise RuntimeError(f"stage {stage.name} is replicated; the comparison needs one device per stage")
        idx = sorted({int(p.split(".")[0]) for op in stage.ops if (p := op.attrs.module_path) and p[0].isdigit()})
        split.append(idx)
    return split


def run_case(cfg: Config, pairs: int, work: Path, deadline: float) -> dict[str, Any]:
    plan_dir = work / f"plan-{cfg.procs}-{cfg.schedule}"
    split = compile_plan(cfg, plan_dir)
    ours: list[list[dict[str, Any]]] = []
    theirs: list[list[dict[str, Any]]] = []
    for k in range(pairs):
        if k > 0 and time.time() > deadline:
            break  # the benchmark's time budget: fewer pairs, never none
        # A B A B: both sides see the same background load in each pair.
        ours.append(launch("dapple", cfg, {"plan": str(plan_dir)}, work))
        theirs.append(launch("torch", cfg, {"split": split}, work))
    ours_s = [step_seconds(r, cfg.warmup) for r in ours]
    theirs_s = [step_seconds(r, cfg.warmup) for r in theirs]
    return {
        "split": split,
        "ours_sps": cfg.global_batch / median(ours_s),
        "torch_sps": cfg.global_batch / median(theirs_s),
        "ratio": median([t / o for o, t in zip(ours_s, theirs_s, strict=True)]),
        "pairs": len(ours),
        "ours_held": [max(run[r]["peak_bytes"] for run in ours) for r in range(cfg.procs)],
        "torch_held": [max(run[r]["peak_bytes"] for run in theirs) for r in range(cfg.procs)],
        "ours_rss": [median([run[r]["maxrss_bytes"] for run in ours]) for r in range(cfg.procs)],
        "torch_rss": [median([run[r]["maxrss_bytes"] for run in theirs]) for r in range(cfg.procs)],
        "ours_loss": first_loss(ours[0]),
        "torch_loss": first_loss(theirs[0]),
    }


def _mb(values: list[float]) -> str:
    return "/".join(f"{v / 2**20:.2f}" for v in values)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "tiny model, 1f1b on 2 processes, one pair")
    parser.add_argument("--pairs", type=int, default=3, help="A/B pairs per case")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds; later pairs are dropped past it")
    parser.add_argument("--rank-worker", choices=["torch", "dapple"], help=argparse.SUPPRESS)
    parser.add_argument("--payload", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_worker:
        payload = json.loads(args.payload)
        cfg = Config(**payload["cfg"])
        if args.rank_worker == "torch":
            torch_rank(cfg, payload["split"], Path(args.out))
        else:
            dapple_rank(cfg, Path(payload["plan"]), Path(args.out))
        return 0

    started = time.time()
    if args.quick:
        cases = [Config("tiny", 2, "1f1b", 4, 32, steps=3, warmup=1)]
        pairs = 1
    else:
        cases = [Config("bench", p, s, 8, 256, steps=12, warmup=2) for p in (2, 4) for s in ("gpipe", "1f1b")]
        pairs = args.pairs
    table = Table(
        "Our runtime vs torch.distributed.pipelining (CPU, gloo, 1 thread per rank)",
        ["procs", "schedule", "M", "ours samples/s", "torch samples/s", "speed-up (torch time / ours)",
         "ours held MiB per rank", "torch held MiB per rank", "ours RSS MiB per rank", "torch RSS MiB per rank",
         "step-0 loss ours", "step-0 loss torch", "pairs"],
    )  # fmt: skip
    report = Report("runtime_vs_torch_pipelining", "Runtime: ours vs torch.distributed.pipelining", [table])
    with tempfile.TemporaryDirectory(prefix="dapple-bench-rt-") as tmp:
        for k, cfg in enumerate(cases):
            deadline = started + args.budget * (k + 1) / len(cases)
            try:
                r = run_case(cfg, pairs, Path(tmp), deadline)
            except Exception as exc:  # a missing part of the project must not sink the other rows
                reason = unavailable(str(exc).splitlines()[0][:200])
                table.add(cfg.procs, cfg.schedule, cfg.microbatches, reason, *["-"] * 9)
                continue
            table.add(
                cfg.procs, cfg.schedule, cfg.microbatches, r["ours_sps"], r["torch_sps"], r["ratio"],
                _mb(r["ours_held"]), _mb(r["torch_held"]), _mb(r["ours_rss"]), _mb(r["torch_rss"]),
                r["ours_loss"], r["torch_loss"], r["pairs"],
            )  # fmt: skip
            report.headlines.append(
                f"{cfg.procs} procs {cfg.schedule}: ours {r['ratio']:.2f}x the speed of torch.distributed.pipelining"
            )
            if args.json:
                report.save(args.json)  # what is done so far survives a hard stop at run_all's limit
    model = "tiny MLP (width 32, 4 layers)" if args.quick else "MLP width 512, 8 Linear layers (2.1M parameters)"
    table.notes += [
        f"model: bench/bench_models.py ({model}), global batch {cases[0].global_batch}, SGD; {pairs} A/B pair(s), "
        f"{cases[0].steps} steps per run, first {cases[0].warmup} dropped; medians.",
        "stage split: the one our planner chose with --stages forced; the torch side cuts the Sequential there.",
        "held = parameters + gradients + optimizer state + saved activations (+ stored values on our side), "
        "peak over the run; RSS = peak resident set of the rank process (includes the ~300 MiB of torch itself).",
    ]
    return report.finish(started, args.json, _plot(table, plot_path(args.json, "runtime_vs_torch_pipelining.png")))


def _plot(table: Table, path: Path) -> str | None:
    """Samples/s of both sides per case, side by side, with the ratio written above each pair."""
    ours_k, theirs_k = table.columns.index("ours samples/s"), table.columns.index("torch samples/s")
    rows = [r for r in table.rows if isinstance(r[ours_k], float) and isinstance(r[theirs_k], float)]
    if not rows:
        return None
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 4.2))
    xs = list(range(len(rows)))
    ours = [float(r[ours_k] or 0) for r in rows]
    theirs = [float(r[theirs_k] or 0) for r in rows]
    ax.bar([x - 0.2 for x in xs], ours, 0.4, label="dapple-ir runtime")
    ax.bar([x + 0.2 for x in xs], theirs, 0.4, label="torch.distributed.pipelining")
    for x, o, t in zip(xs, ours, theirs, strict=True):
        ax.text(x, max(o, t) * 1.02, f"{o / t:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(xs, [f"{r[0]} procs\n{r[1]}" for r in rows])
    ax.set_ylabel("samples/s (median)")
    ax.set_title("Same model, split and schedule on CPU/gloo (label: ours / torch throughput)")
    ax.set_ylim(0, max(ours + theirs) * 1.15)
    ax.legend(loc="lower right")
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
