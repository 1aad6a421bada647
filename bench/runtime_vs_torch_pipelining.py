"""Our runtime vs `torch.distributed.pipelining`: same model, same stage split, same schedule, CPU + gloo.

For each (model, processes, schedule) the two sides alternate A B A B ...: ours is `dapple compile`
of `bench/bench_models.py:mlp_bench` (MLP) or `:gpt_bench` (GPT-style, d=256, 8 blocks, seq 64,
batch 32) with forced stage count, schedule and microbatch count and no replication, run by the
worker that `dapple run` launches through torchrun; theirs is the same `nn.Sequential` (same seed,
same data) split by `torch.distributed.pipelining.pipeline` at the very ops where our plan cut (a
`SplitPoint.BEGINNING` at the module of each stage's first op, or `SplitPoint.END` at the module just
before it when that op is a plain function such as a residual add), driven by `ScheduleGPipe`,
`Schedule1F1B` or, for zb-h1, `ScheduleInterleavedZeroBubble` with one stage per rank (torch's
zero-bubble schedule closest to ZB-H1: `ScheduleZBVZeroBubble` needs two stages per rank), launched
by the same torchrun. Interleaved schedules are left out: the comparison needs one stage per rank.

Idle per rank: from our measured timeline, the share of each step (first rank's start to last
rank's end) a rank spent outside forward/backward spans, median over the steps after warm-up; beside
it the simulator's bubble for the same plan with each stage's forward and backward durations set to
the measured medians (ideal links), i.e. the idle the schedule itself implies.

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

SPEC = {
    "tiny": "bench/bench_models.py:mlp_tiny",
    "bench": "bench/bench_models.py:mlp_bench",
    "gpt-tiny": "bench/bench_models.py:gpt_tiny",
    "gpt": "bench/bench_models.py:gpt_bench",
}
#: The model each size names, for the table.
MODEL = {"tiny": "MLP tiny", "bench": "MLP", "gpt-tiny": "GPT tiny", "gpt": "GPT"}


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
    device: str = "cpu"
    """`cuda`: NCCL, one GPU per rank (bench/device_check.sh); else gloo on the CPU."""


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


def torch_rank(cfg: Config, cuts: dict[str, str], out_dir: Path) -> None:
    """One rank of the torch.distributed.pipelining side (runs under torchrun)."""
    import datetime

    import torch
    import torch.distributed as dist
    from bench_models import build_model
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleavedZeroBubble,
        SplitPoint,
        pipeline,
    )

    from dapple_ir.backends.torch.data import synthetic_batch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout))
    # The same seed before the same factory as our runtime: identical initial weights.
    torch.manual_seed(cfg.seed)
    model, inputs, loss_fn, targets = build_model(cfg.size)
    (x0,), _ = synthetic_batch(inputs, targets, cfg.global_batch, cfg.seed, 0)
    example = x0[: cfg.global_batch // cfg.microbatches]
    points = {"beginning": SplitPoint.BEGINNING, "end": SplitPoint.END}
    pipe = pipeline(model, mb_args=(example,), split_spec={path: points[at] for path, at in cuts.items()})
    if pipe.num_stages != world:
        raise RuntimeError(f"torch split the model into {pipe.num_stages} stages at {cuts}, not {world}")
    stage = pipe.build_stage(rank, device)
    sub = pipe.get_stage_module(rank)
    del model
    if cfg.schedule == "zb-h1":
        # torch's zero-bubble backward detaches the stage's outputs in place, which a view (a Linear's
        # output on a 3-D input) refuses: such an output is copied once per microbatch, on torch's side.
        sub.register_forward_hook(_owned_outputs)
        schedule: Any = ScheduleInterleavedZeroBubble([stage], n_microbatches=cfg.microbatches, loss_fn=loss_fn)
    else:
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
        x, y = x.to(device), y.to(device)
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
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the step's end is when the GPU is done, as on our side
        step_times[str(step)] = [start, time.time()]
        losses[str(step)] = {str(m): float(v) for m, v in enumerate(mb_losses)}
    dist.barrier()
    dist.destroy_process_group()
    report = {"rank": rank, "step_times": step_times, "peak_bytes": meter.peak, "losses": losses}
    _write_rank(out_dir, rank, report)


def _owned_outputs(_module: Any, _args: Any, output: Any) -> Any:
    """A stage's outputs with every view replaced by a copy of its own."""
    if isinstance(output, tuple):
        return tuple(_owned_outputs(_module, _args, o) for o in output)
    return output.clone() if hasattr(output, "_is_view") and output._is_view() else output


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
        steps=cfg.steps, optimizer="sgd", lr=cfg.lr, timeout=cfg.timeout, run_dir=str(out_dir), device=cfg.device
    )
    # The very flags `dapple run` gives the worker it launches.
    code = worker.main([str(plan_dir), *worker.worker_flags(options)])
    if code != 0:
        raise SystemExit(code)
    report = json.loads((out_dir / f"rank_{rank}.json").read_text())
    _write_rank(out_dir, rank, {k: report[k] for k in ("rank", "step_times", "peak_bytes", "losses", "spans")})


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


def compile_plan(cfg: Config, plan_dir: Path) -> dict[str, str]:
    """`dapple compile` with stages, schedule and microbatches forced; where torch must cut to match it."""
    cmd = [
        str(ROOT / ".venv" / "bin" / "dapple"), "compile", SPEC[cfg.size], "--cluster", f"{cfg.procs}xcpu",
        "--global-batch", str(cfg.global_batch), "--stages", str(cfg.procs), "--microbatches",
        str(cfg.microbatches), "--schedule", cfg.schedule, "--optimizer", "sgd", "-o", str(plan_dir),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"dapple compile failed: {(proc.stderr or proc.stdout).strip()[-400:]}")
    return split_points(plan_dir)


def split_points(plan_dir: Path) -> dict[str, str]:
    """Where torch must cut to match the plan: each later stage starts at the beginning of the module of its first
    computing op, or (an op outside any module of its own, a residual add) at the end of the module just before it.
    """
    from dapple_ir.ir import OpKind
    from dapple_ir.ir.parser import parse_module

    module = parse_module((plan_dir / "plan.dapple").read_text(), str(plan_dir / "plan.dapple"))
    computing = [op for op in module.ops if op.kind not in (OpKind.INPUT, OpKind.GET_ATTR, OpKind.OUTPUT)]
    cuts: dict[str, str] = {}
    for stage in module.stages[1:]:
        if stage.replicas != 1:
            raise RuntimeError(f"stage {stage.name} is replicated; the comparison needs one device per stage")
        members = set(stage.ops)
        k = next(k for k, op in enumerate(computing) if op in members)
        first, before = computing[k], computing[k - 1]
        if first.kind is OpKind.CALL_MODULE and first.attrs.module_path:
            cuts[first.attrs.module_path] = "beginning"
        elif before.kind is OpKind.CALL_MODULE and before.attrs.module_path:
            cuts[before.attrs.module_path] = "end"
        else:
            raise RuntimeError(f"stage {stage.name} starts between plain ops (%{first.name}); torch cannot cut there")
    return cuts


def idle_shares(reports: list[dict[str, Any]], warmup: int) -> list[float]:
    """Per rank: the median share of a step (first rank's start to last rank's end) spent outside compute spans."""
    steps = sorted(int(k) for k in reports[0]["step_times"])[warmup:]
    shares: list[list[float]] = [[] for _ in reports]
    for k in steps:
        start = min(float(r["step_times"][str(k)][0]) for r in reports)
        end = max(float(r["step_times"][str(k)][1]) for r in reports)
        for rank, r in enumerate(reports):
            own = r["step_times"][str(k)]
            busy = sum(
                sp["end_s"] - sp["start_s"]
                for sp in r["spans"]
                if sp["kind"] in COMPUTE and own[0] <= sp["start_s"] and sp["end_s"] <= own[1]
            )
            shares[rank].append(1.0 - busy / (end - start))
    return [median(v) for v in shares]


#: Span kinds that run a stage's computation.
COMPUTE = ("forward", "backward", "backward_input", "backward_weight")


def simulated_bubble(plan_dir: Path, runs: list[list[dict[str, Any]]], warmup: int) -> list[float]:
    """The simulator's bubble per rank for the plan, each stage's compute taking its measured median (ideal links)."""
    from dapple_ir.analysis.memory import batch_scale
    from dapple_ir.ir.parser import parse_module
    from dapple_ir.sim.simulator import ideal_cluster, simulate

    module = parse_module((plan_dir / "plan.dapple").read_text(), str(plan_dir / "plan.dapple"))
    durations: dict[tuple[str, str], list[float]] = {}
    for reports in runs:
        for r in reports:
            first = min(float(r["step_times"][str(k)][0]) for k in range(warmup, len(r["step_times"])))
            for sp in r["spans"]:
                if sp["kind"] in COMPUTE and sp["start_s"] >= first:
                    durations.setdefault((sp["kind"], sp["stage"]), []).append(sp["end_s"] - sp["start_s"])
    scale = batch_scale(module)
    fractions: list[float] = []
    for stage in module.stages:
        fwd = median(durations.get(("forward", stage.name), [0.0]))
        split = ("backward_input", stage.name) in durations
        b_in = median(durations.get(("backward_input", stage.name), [0.0]))
        b_w = median(durations.get(("backward_weight", stage.name), [0.0]))
        bwd = b_in + b_w if split else median(durations.get(("backward", stage.name), [0.0]))
        if split and bwd > 0:
            fractions.append(b_in / bwd)
        # Spread the measured time over the stage's ops in proportion to their modelled cost.
        for attr, total in (("fwd_s", fwd), ("bwd_s", bwd)):
            modelled = sum(getattr(op.attrs, attr) or 0.0 for op in stage.ops) * scale
            for op in stage.ops:
                own = getattr(op.attrs, attr) or 0.0
                setattr(op.attrs, attr, own * total / modelled if modelled > 0 else total / scale / len(stage.ops))
    fraction = median(fractions) if fractions else 0.5
    result = simulate(module, cluster=ideal_cluster(len(module.programs)), backward_input_fraction=fraction)
    return list(result.bubble_fraction)


def run_case(cfg: Config, pairs: int, work: Path, deadline: float) -> dict[str, Any]:
    plan_dir = work / f"plan-{cfg.size}-{cfg.procs}-{cfg.schedule}"
    cuts = compile_plan(cfg, plan_dir)
    ours: list[list[dict[str, Any]]] = []
    theirs: list[list[dict[str, Any]]] = []
    for k in range(pairs):
        if k > 0 and time.time() > deadline:
            break  # the benchmark's time budget: fewer pairs, never none
        # A B A B: both sides see the same background load in each pair.
        ours.append(launch("dapple", cfg, {"plan": str(plan_dir)}, work))
        theirs.append(launch("torch", cfg, {"cuts": cuts}, work))
    ours_s = [step_seconds(r, cfg.warmup) for r in ours]
    theirs_s = [step_seconds(r, cfg.warmup) for r in theirs]
    idle = [idle_shares(r, cfg.warmup) for r in ours]
    return {
        "cuts": cuts,
        "ours_sps": cfg.global_batch / median(ours_s),
        "torch_sps": cfg.global_batch / median(theirs_s),
        "ratio": median([t / o for o, t in zip(ours_s, theirs_s, strict=True)]),
        "pairs": len(ours),
        "idle": [median([run[r] for run in idle]) for r in range(cfg.procs)],
        "bubble": simulated_bubble(plan_dir, ours, cfg.warmup),
        "ours_held": [max(run[r]["peak_bytes"] for run in ours) for r in range(cfg.procs)],
        "torch_held": [max(run[r]["peak_bytes"] for run in theirs) for r in range(cfg.procs)],
        "ours_rss": [median([run[r]["maxrss_bytes"] for run in ours]) for r in range(cfg.procs)],
        "torch_rss": [median([run[r]["maxrss_bytes"] for run in theirs]) for r in range(cfg.procs)],
        "ours_loss": first_loss(ours[0]),
        "torch_loss": first_loss(theirs[0]),
    }


def _pct(values: list[float]) -> str:
    return "/".join(f"{100 * v:.0f}" for v in values)


def _mb(values: list[float]) -> str:
    return "/".join(f"{v / 2**20:.2f}" for v in values)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, "tiny model, 1f1b on 2 processes, one pair")
    parser.add_argument("--pairs", type=int, default=3, help="A/B pairs per case")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds; later pairs are dropped past it")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, one GPU per rank")
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4], help="rank counts to compare (full run)")
    parser.add_argument("--rank-worker", choices=["torch", "dapple"], help=argparse.SUPPRESS)
    parser.add_argument("--payload", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_worker:
        payload = json.loads(args.payload)
        cfg = Config(**payload["cfg"])
        if args.rank_worker == "torch":
            torch_rank(cfg, payload["cuts"], Path(args.out))
        else:
            dapple_rank(cfg, Path(payload["plan"]), Path(args.out))
        return 0

    started = time.time()
    if args.quick:
        cases = [
            Config("tiny", 2, "1f1b", 4, 32, steps=3, warmup=1),
            Config("gpt-tiny", 2, "zb-h1", 4, 16, steps=3, warmup=1),
        ]
        pairs = 1
    else:
        cases = [
            Config(size, p, s, m, batch, steps=steps, warmup=2, device=args.device)
            for size, batch, steps in (("bench", 256, 12), ("gpt", 32, 8))
            for p in args.procs
            for s in ("gpipe", "1f1b", "zb-h1")
            for m in [4 if size == "gpt" and p == 2 else 8]
        ]
        pairs = args.pairs
    table = Table(
        "Our runtime vs torch.distributed.pipelining "
        + ("(CUDA, NCCL, one GPU per rank)" if args.device == "cuda" else "(CPU, gloo, 1 thread per rank)"),
        ["model", "procs", "schedule", "M", "ours samples/s", "torch samples/s", "speed-up (torch time / ours)",
         "ours idle % per rank", "simulated bubble % per rank", "worst idle gap (points)",
         "ours held MiB per rank", "torch held MiB per rank", "ours RSS MiB per rank", "torch RSS MiB per rank",
         "step-0 loss ours", "step-0 loss torch", "pairs"],
    )  # fmt: skip
    report = Report("runtime_vs_torch_pipelining", "Runtime: ours vs torch.distributed.pipelining", [table])
    ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="dapple-bench-rt-") as tmp:
        for k, cfg in enumerate(cases):
            deadline = started + args.budget * (k + 1) / len(cases)
            try:
                r = run_case(cfg, pairs, Path(tmp), deadline)
            except Exception as exc:  # a missing part of the project must not sink the other rows
                reason = unavailable(str(exc).splitlines()[0][:200])
                table.add(MODEL[cfg.size], cfg.procs, cfg.schedule, cfg.microbatches, reason, *["-"] * 12)
                continue
            gap = max(abs(i - b) for i, b in zip(r["idle"], r["bubble"], strict=True))
            table.add(
                MODEL[cfg.size], cfg.procs, cfg.schedule, cfg.microbatches, r["ours_sps"], r["torch_sps"], r["ratio"],
                _pct(r["idle"]), _pct(r["bubble"]), 100 * gap,
                _mb(r["ours_held"]), _mb(r["torch_held"]), _mb(r["ours_rss"]), _mb(r["torch_rss"]),
                r["ours_loss"], r["torch_loss"], r["pairs"],
            )  # fmt: skip
            ratios.append(r["ratio"])
            report.headlines.append(
                f"{MODEL[cfg.size]} {cfg.procs} procs {cfg.schedule}: ours {r['ratio']:.2f}x the speed of "
                "torch.distributed.pipelining"
            )
            if args.json:
                report.save(args.json)  # what is done so far survives a hard stop at run_all's limit
    if ratios:
        report.headlines.append(f"median speed-up {median(ratios):.2f}x, lowest {min(ratios):.2f}x")
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    table.notes += [
        "models: bench/bench_models.py: MLP width 512, 8 Linear layers (2.1M parameters), global batch 256; "
        "GPT-style d=256, 8 blocks, seq 64, 4 heads, vocabulary 512, global batch 32 (tiny sizes with --quick); SGD; "
        f"{pairs} A/B pair(s) per case, the first 2 steps (1 with --quick) dropped; medians.",
        "stage split: the one our planner chose with --stages forced; torch's pipeline() splits at the same ops. "
        "zb-h1 on the torch side: ScheduleInterleavedZeroBubble with one stage per rank; a stage output that "
        "is a view (a Linear's output on a 3-D input) is copied there, since torch's zero-bubble backward "
        "detaches outputs in place and fails on views.",
        "idle = share of the step a rank spends outside forward/backward; simulated bubble = the simulator's idle "
        "for the same plan with the measured stage durations and free links; gap = the larger difference.",
        "held = parameters + gradients + optimizer state + saved activations (+ stored values on our side), "
        "peak over the run; RSS = peak resident set of the rank process (includes the ~300 MiB of torch itself).",
        f"load average (1, 5, 15 min) at the end: {load}.",
    ]
    return report.finish(started, args.json, _plot(table, plot_path(args.json, "runtime_vs_torch_pipelining.png")))


def _plot(table: Table, path: Path) -> str | None:
    """Samples/s of both sides per case, side by side, with the ratio written above each pair."""
    ours_k, theirs_k = table.columns.index("ours samples/s"), table.columns.index("torch samples/s")
    rows = [r for r in table.rows if isinstance(r[ours_k], float) and isinstance(r[theirs_k], float)]
    if not rows:
        return None
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(11, 4.6))
    xs = list(range(len(rows)))
    ours = [float(r[ours_k] or 0) for r in rows]
    theirs = [float(r[theirs_k] or 0) for r in rows]
    ax.bar([x - 0.2 for x in xs], ours, 0.4, label="dapple-ir runtime")
    ax.bar([x + 0.2 for x in xs], theirs, 0.4, label="torch.distributed.pipelining")
    for x, o, t in zip(xs, ours, theirs, strict=True):
        ax.text(x, max(o, t) * 1.02, f"{o / t:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(xs, [f"{r[0]}\n{r[1]} procs\n{r[2]}" for r in rows], fontsize=7)
    ax.set_ylabel("samples/s (median)")
    ax.set_title("Same model, split and schedule on CPU/gloo (label: ours / torch throughput)")
    ax.set_ylim(0, max(ours + theirs) * 1.15)
    ax.legend(loc="lower right")
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
