"""Our runtime vs `torch.distributed.pipelining`: same model, same stage split, same schedule, CPU + gloo.

For each (model, processes, schedule) the two sides alternate A B, B A, ... inside one torchrun launch (its
rank processes run each side in turn, each run with a rendezvous of its own): ours is `dapple compile`
of `bench/bench_models.py:mlp_bench` (MLP) or `:gpt_bench` (GPT-style, d=256, 8 blocks, seq 64,
batch 32) with forced stage count, schedule and microbatch count and no replication, run by the
worker that `dapple run` launches; theirs is the same `nn.Sequential` (same seed,
same data) split by `torch.distributed.pipelining.pipeline` at the very ops where our plan cut (a
`SplitPoint.BEGINNING` at the module of each stage's first op, or `SplitPoint.END` at the module just
before it when that op is a plain function such as a residual add), driven by `ScheduleGPipe`,
`Schedule1F1B` or, for zb-h1, `ScheduleInterleavedZeroBubble` with one stage per rank (torch's
zero-bubble schedule closest to ZB-H1: `ScheduleZBVZeroBubble` needs two stages per rank), and for
interleaved (V = 2 stages per rank, stage k on rank k % ranks on both sides) `ScheduleInterleaved1F1B`,
launched by the same torchrun.

Waiting per rank, measured beside simulated, one definition for both: the share of the step period a rank
spends waiting for other ranks; all else it does (compute, optimizer step, the host's own work) is busy. The
simulator gets what the run measured: compute spans, each rank's host work, its optimizer step, and a link
fitted to the transfers (`simulated_waiting`). A second table measures what early receive posts buy: a few
cases also run, inside each A/B pair, a copy of our plan whose rank files post no receive early.

Per run: every rank records each step's wall-clock start and end; a step's time is the gap between
the last rank finishing it and the last rank finishing the step before, and the run's figure is the
median over the steps after warm-up. samples/s = global batch / that median. The ratio is taken
per pair (A, B adjacent in time) and the table shows the median ratio. Memory per rank: peak bytes
of tensors held (parameters, gradients, optimizer state, saved activations, stored values: our
runtime's own meter; on the torch side the same categories through `saved_tensors_hooks`) and the
peak RSS of the rank process.

    .venv/bin/python bench/runtime_vs_torch_pipelining.py            # full
    .venv/bin/python bench/runtime_vs_torch_pipelining.py --quick    # seconds, tiny model
    .venv/bin/python bench/runtime_vs_torch_pipelining.py --keep-runs /tmp/rt    # full, runs stored
    .venv/bin/python bench/runtime_vs_torch_pipelining.py --from-runs /tmp/rt    # the same runs analysed again
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import random
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from host_noise import HostNoise, measure_host_noise, spread  # noqa: E402
from tables import Report, Table, bench_parser, median, plot_path, pyplot, save_figure, unavailable  # noqa: E402

from dapple_ir.backends.torch.cores import pin_rank, set_cores  # noqa: E402
from dapple_ir.backends.torch.host_time import blocked, wake_delays  # noqa: E402
from dapple_ir.cluster.spec import MAX_BUSY_RECEIVE_SLOWDOWN, ClusterSpec, DeviceKind, Link  # noqa: E402
from dapple_ir.frontend.calibration_fits import fit_link as fitted_link  # noqa: E402
from dapple_ir.frontend.calibration_fits import fit_wake  # noqa: E402
from dapple_ir.ir.parser import parse_module  # noqa: E402
from dapple_ir.sim.simulator import HOST_BUSY_KINDS  # noqa: E402

SPEC = {
    "tiny": "bench/bench_models.py:mlp_tiny",
    "bench": "bench/bench_models.py:mlp_bench",
    "gpt-tiny": "bench/bench_models.py:gpt_tiny",
    "gpt": "bench/bench_models.py:gpt_bench",
}
#: The model each size names, for the table.
MODEL = {"tiny": "MLP tiny", "bench": "MLP", "gpt-tiny": "GPT tiny", "gpt": "GPT"}
#: Each schedule compared, with its stages per rank.
VIRTUAL = {"gpipe": 1, "1f1b": 1, "zb-h1": 1, "interleaved": 2}
#: (size, processes, schedule) of the cases also run without early receive posts, without the posts' headroom,
#: without reused receive buffers and unpinned (the ablation table).
ABLATED = {("bench", 2, "zb-h1"), ("bench", 2, "interleaved"), ("gpt", 2, "1f1b")}
#: The ablation's sides: ours without early receive posts; ours posting early only within the peak (no
#: `peak_memory.post_headroom`: the rule before it); ours receiving into a new buffer every time; ours with each
#: rank wherever the OS puts it (the worker's `--no-pin`). (Metering every step, measured until 2026-12-02, gave
#: way to the headroom: docs/runtime.md has its readings.)
ABLATIONS = ("bare", "tight", "fresh", "unpinned")
#: Each ablation side's receive posts (`posts_as`); every other side posts as compiled.
POSTS = {"bare": "none", "tight": "tight"}


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
    virtual: int = 1
    """Stages per rank (the interleaved schedule's V); stage k on rank k % procs on both sides."""
    posts: str = "compiled"
    """The rank files' early receive posts (`posts_as`): `compiled`, or for the ablation `none` (no receive posted
    ahead of its `recv`) or `tight` (posted early only within the peak, no `peak_memory.post_headroom`)."""
    reuse_buffers: bool = True
    """False: every receive into a new buffer (the worker's `--fresh-buffers`), for the ablation."""
    pin_cores: bool = True
    """False: our ranks wherever the OS puts them (the worker's `--no-pin`), for the ablation. torch's ranks are
    pinned as ours are (`cores.pin_rank`): the launcher's choice, not the pipeline's."""


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
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        SplitPoint,
        pipeline,
    )

    from dapple_ir.backends.torch.data import synthetic_batch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":  # as our worker pins its CPU ranks, before gloo starts its threads
        pin_rank(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
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
    if pipe.num_stages != world * cfg.virtual:
        raise RuntimeError(f"torch split the model into {pipe.num_stages} stages at {cuts}, not {world * cfg.virtual}")
    # Stage k on rank k % world: Megatron's interleaved placement, as our plan's (one stage per rank at V = 1).
    mine = range(rank, pipe.num_stages, world)
    stages: list[Any] = [pipe.build_stage(k, device) for k in mine]
    subs = [pipe.get_stage_module(k) for k in mine]
    del model
    if cfg.schedule == "zb-h1":
        # torch's zero-bubble backward detaches the stage's outputs in place, which a view (a Linear's
        # output on a 3-D input) refuses: such an output is copied once per microbatch, on torch's side.
        subs[0].register_forward_hook(_owned_outputs)
        schedule: Any = ScheduleInterleavedZeroBubble(stages, n_microbatches=cfg.microbatches, loss_fn=loss_fn)
    elif cfg.schedule == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=cfg.microbatches, loss_fn=loss_fn)
    else:
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[cfg.schedule]
        schedule = kind(stages[0], n_microbatches=cfg.microbatches, loss_fn=loss_fn)
    params = [p for sub in subs for p in sub.parameters()]
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
        losses[str(step)] = {str(m): float(v.detach()) for m, v in enumerate(mb_losses)}
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
    report["maxrss_bytes"] = _peak_rss()
    (out_dir / f"bench_rank_{rank}.json").write_text(json.dumps(report))


def _fresh_peak() -> None:
    """Start a new peak resident set: what the previous side freed goes back to the system (glibc's `malloc_trim`),
    then Linux forgets the old peak (`clear_refs` 5), so that `_peak_rss` is the next side's own."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _peak_rss() -> int:
    """Peak resident bytes since `_fresh_peak` (VmHWM); where Linux has no such field, the process's peak."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_pairs(payload: dict[str, Any], out_dir: Path) -> None:
    """One rank of a whole case: pair after pair, each side in turn in this one process (`launch_case`)."""
    import datetime

    import torch.distributed as dist

    cfg = Config(**payload["cfg"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Each run pins the process as its side would (or not): every run starts from the cores it was given.
    given = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    # torchrun's own store: rank 0 says whether another pair fits the budget, and every rank hears the same.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False,
        timeout=datetime.timedelta(seconds=cfg.timeout),
    )  # fmt: skip
    for k in range(payload["pairs"]):
        if rank == 0:
            store.set(f"dapple-bench/pair-{k}", "go" if k == 0 or time.time() < payload["deadline"] else "stop")
        if store.get(f"dapple-bench/pair-{k}") != b"go":
            break
        # Every other pair in the reverse order: neither side always runs in the warmer process.
        for side in payload["sides"] if k % 2 == 0 else payload["sides"][::-1]:
            out = out_dir / f"{k}-{side['name']}"
            out.mkdir(exist_ok=True)
            _fresh_peak()
            set_cores(given)
            # A fresh rendezvous for each run: a process group initialised again on torchrun's store would find the
            # previous run's keys there (gloo would dial its closed sockets). Rank 0 hosts a new store on a free port.
            key = f"dapple-bench/port-{k}-{side['name']}"
            if rank == 0:
                store.set(key, str(free_port()))
            os.environ["MASTER_PORT"] = store.get(key).decode()
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
            if side["name"] == "torch":
                torch_rank(cfg, side["cuts"], out)
            else:
                ablated = replace(
                    cfg,
                    posts=POSTS.get(side["name"], "compiled"),
                    reuse_buffers=side["name"] != "fresh",
                    pin_cores=side["name"] != "unpinned",
                )
                dapple_rank(ablated, Path(side["plan"]), out)


# ----------------------------------------------------------------------------- our side (rank)


def dapple_rank(cfg: Config, plan_dir: Path, out_dir: Path) -> None:
    """One rank of our runtime: the worker `dapple run` launches, plus the peak RSS of this process."""
    import torch

    from dapple_ir.backends.torch import worker

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    options = worker.RunOptions(
        steps=cfg.steps,
        optimizer="sgd",
        lr=cfg.lr,
        timeout=cfg.timeout,
        run_dir=str(out_dir),
        device=cfg.device,
        reuse_buffers=cfg.reuse_buffers,
        pin_cores=cfg.pin_cores,
    )
    # The very flags `dapple run` gives the worker it launches; the worker checks the rank files against codegen,
    # which must then post as they do.
    with posts_as(cfg.posts):
        code = worker.main([str(plan_dir), *worker.worker_flags(options)])
    if code != 0:
        raise SystemExit(code)
    report = json.loads((out_dir / f"rank_{rank}.json").read_text())
    kept = ("rank", "step_times", "peak_bytes", "losses", "spans", "recv_buffers")
    _write_rank(out_dir, rank, {k: report[k] for k in kept})


# ----------------------------------------------------------------------------- driver


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_case(
    cfg: Config, sides: dict[str, dict[str, Any]], pairs: int, deadline: float, work: Path
) -> dict[str, list[list[dict[str, Any]]]]:
    """Run a case's pairs under one torchrun on 127.0.0.1, every side of a pair in the same rank processes (one
    start-up per case, not per run: it is 10-16 s of a 4-rank launch on 2 cores). `sides` by name: `ours`, `torch`,
    `bare` (our plan without early receive posts), `tight` (ours posting early only within the peak), `fresh`
    (ours without reused receive buffers), `unpinned` (ours with its ranks wherever the OS puts them). Per side,
    per pair run, the rank reports in rank order."""
    out_dir = Path(tempfile.mkdtemp(prefix="case-", dir=work))
    payload = json.dumps(
        {
            "cfg": asdict(cfg),
            "sides": [{"name": n, **v} for n, v in sides.items()],
            "pairs": pairs,
            "deadline": deadline,
        }
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.procs}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        str(Path(__file__).resolve()), "--rank-worker", "--payload", payload, "--out", str(out_dir),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{BENCH}{os.pathsep}{ROOT}"}
    limit = pairs * len(sides) * (cfg.timeout + 60) + 120
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
    if proc.returncode != 0:
        # Our worker writes error_rank_<r>.json; otherwise the first exception line any rank printed.
        reports = sorted(out_dir.glob("*/error_rank_*.json"))
        if reports:
            raise RuntimeError(f"{reports[0].parent.name} run failed: {json.loads(reports[0].read_text())['message']}")
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        errors = [ln for ln in lines if re.search(r"\w+(Error|Exception)\b:", ln) and "ChildFailedError" not in ln]
        raise RuntimeError(f"run failed ({proc.returncode}): " + (errors[0] if errors else " | ".join(lines[-3:])))
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in sides}
    for k in range(pairs):
        for name in sides:
            run_dir = out_dir / f"{k}-{name}"
            if run_dir.is_dir():
                runs[name].append(
                    [json.loads((run_dir / f"bench_rank_{r}.json").read_text()) for r in range(cfg.procs)]
                )
    return runs


def reused_share(counts: dict[str, int]) -> float:
    """The share of a rank's receives that landed in a buffer it had already (`ReceiveBuffers`)."""
    total = counts["allocated"] + counts["reused"]
    return counts["reused"] / total if total else 0.0


def step_periods(reports: list[dict[str, Any]], warmup: int) -> list[float]:
    """Per step after warm-up (`_steps`, from step 1 on): (last rank done with step k) - (last rank done with step
    k-1)."""
    steps = sorted(int(k) for k in reports[0]["step_times"])
    ends = [max(float(r["step_times"][str(k)][1]) for r in reports) for k in steps]
    return [ends[i] - ends[i - 1] for i in range(max(1, warmup), len(ends))]


def step_spread(reports: list[dict[str, Any]], warmup: int) -> float:
    """How much a run's steps vary from one to the next: the interquartile range of `step_periods` over their
    median (`host_noise.spread`, the figure the machine's own noise is given in; 0 with fewer than 2 steps)."""
    return spread(step_periods(reports, warmup))


def step_seconds(reports: list[dict[str, Any]], warmup: int) -> float:
    """The median of `step_periods`: the period a run's samples/s is taken from."""
    return median(step_periods(reports, warmup))


def first_loss(reports: list[dict[str, Any]]) -> float:
    """Mean microbatch loss of step 0, from the rank that computed it."""
    for r in reports:
        mbs = r.get("losses", {}).get("0", {})
        if mbs:
            return sum(float(v) for v in mbs.values()) / len(mbs)
    return float("nan")


def compile_plan(cfg: Config, plan_dir: Path) -> dict[str, str]:
    """`dapple compile` (its Python API, in this process) with stages, schedule and microbatches forced; where torch
    must cut to match it. Where the planner cut inside a module between plain ops (`torch.distributed.pipelining`
    cuts only at modules), the plan is compiled again with its layers coarsened to the model's top-level modules,
    so that both cut alike."""
    from dapple_ir.api import compile as dapple_compile

    def compiled(max_layers: int | None) -> dict[str, str]:
        dapple_compile(
            str(ROOT / SPEC[cfg.size]), cluster=f"{cfg.procs}xcpu", global_batch=cfg.global_batch,
            stages=cfg.procs * cfg.virtual, virtual=cfg.virtual, microbatches=cfg.microbatches,
            schedule=cfg.schedule, optimizer="sgd", out_dir=plan_dir, max_layers=max_layers, force=True,
        )  # fmt: skip
        return split_points(plan_dir)

    try:
        return compiled(None)
    except Uncuttable:
        from bench_models import build_model

        return compiled(len(build_model(cfg.size)[0]))


class Uncuttable(RuntimeError):
    """The plan cuts where `torch.distributed.pipelining` cannot."""


@contextlib.contextmanager
def posts_as(posts: str) -> Iterator[None]:
    """Codegen whose rank files post receives as `posts` says (`Config.posts`): `compiled` as `peak_memory.recv_posts`
    marks them; `none`, no `rt.post_recv` (each receive then goes out with the sends just before it,
    `Runtime.recv`); `tight`, early only where the buffer keeps the rank within its peak (no headroom)."""
    from dapple_ir.analysis.peak_memory import recv_posts
    from dapple_ir.backends.torch import codegen

    marks = codegen.recv_posts
    if posts == "none":
        codegen.recv_posts = lambda module, program: {}
    elif posts == "tight":
        codegen.recv_posts = lambda module, program: recv_posts(module, program, headroom=0.0)
    try:
        yield
    finally:
        codegen.recv_posts = marks


def plan_with_posts(plan_dir: Path, posts: str) -> Path:
    """A copy of the plan whose rank files post receives as `posts` says (same plan.dapple, same schedule), sealed
    anew."""
    from dapple_ir.backends.torch.codegen import emit_rank_programs
    from dapple_ir.plan_dir import PLAN_JSON, write_plan_json

    copy = plan_dir.with_name(f"{plan_dir.name}-posts-{posts}")
    shutil.copytree(plan_dir, copy, dirs_exist_ok=True)
    with posts_as(posts):
        emit_rank_programs(parse_module((copy / "plan.dapple").read_text(), str(copy / "plan.dapple")), copy)
    write_plan_json(copy, json.loads((copy / PLAN_JSON).read_text()))
    return copy


def split_points(plan_dir: Path) -> dict[str, str]:
    """Where torch must cut to match the plan: each later stage starts at the beginning of the module of its first
    computing op, or (an op outside any module of its own, a residual add) at the end of the module just before it.
    """
    from dapple_ir.ir import OpKind

    module = parse_module((plan_dir / "plan.dapple").read_text(), str(plan_dir / "plan.dapple"))
    computing = [op for op in module.ops if op.kind not in (OpKind.INPUT, OpKind.GET_ATTR, OpKind.OUTPUT)]
    cuts: dict[str, str] = {}
    ranks = len({d for stage in module.stages for d in stage.attrs.devices or ()})
    for k, stage in enumerate(module.stages):
        if stage.replicas != 1 or stage.attrs.devices != (k % ranks,):
            raise RuntimeError(
                f"stage {stage.name} is on devices {list(stage.attrs.devices or ())}; the comparison needs stage k on "
                f"rank k % {ranks} alone"
            )
    for stage in module.stages[1:]:
        members = set(stage.ops)
        k = next(k for k, op in enumerate(computing) if op in members)
        first, before = computing[k], computing[k - 1]
        if first.kind is OpKind.CALL_MODULE and first.attrs.module_path:
            cuts[first.attrs.module_path] = "beginning"
        elif before.kind is OpKind.CALL_MODULE and before.attrs.module_path:
            cuts[before.attrs.module_path] = "end"
        else:
            raise Uncuttable(f"stage {stage.name} starts between plain ops (%{first.name}); torch cannot cut there")
    return cuts


#: Span kinds that run a stage's computation.
COMPUTE = ("forward", "backward", "backward_input", "backward_weight")
#: Span kinds during which a rank's transport thread waits for its core: its own work, the simulator's
#: `HOST_BUSY_KINDS` (computation, the optimizer step, loads and frees), by the names the spans carry.
HOLDING = frozenset(kind.value for kind in HOST_BUSY_KINDS)
#: Span kinds in which a rank may wait for other ranks (on top of what the call itself costs it).
WAITS = ("recv", "allreduce")
#: Span kinds a replayed step times (`step_durations`): the rank's own work, each where it ran. A load before a
#: receive runs while the rank waits for the data (a step's first load makes the global batch: 2.4 ms of a 55 ms
#: MLP step), so it is timed in place, not carried past the wait to the next computation.
REPLAYED = (*COMPUTE, "optimizer_step", "load_microbatch", "free")


@dataclass(frozen=True)
class RankCosts:
    """What one rank's steps cost, measured: medians over the steps after warm-up."""

    busy_s: float
    """The rank's own step (its start to its end) less the time it waited for other ranks."""
    optimizer_s: float
    compute: dict[tuple[str, str], float]
    """Median span of each (kind, stage) the rank computes."""
    counts: dict[tuple[str, str], int]
    """How many of each a step runs."""
    queued_s: float = 0.0
    """Of the time the rank waited, what it spent runnable but waiting for a CPU (`Span.queued_s`): cores shared
    with other ranks, not the plan."""
    loads: dict[int, float] = field(default_factory=dict)
    """Median span of each load by its index in the rank's program: a step's first load makes the global batch."""
    busy_steps: tuple[float, ...] = ()
    """`busy_s` of each step after warm-up (`_steps`), whose median it is."""

    @property
    def work_factor(self) -> float:
        """Busy time outside the optimizer step and the loads per second of median compute: 1 + the host's share
        (issuing sends, posting receives, frees, the memory meter, Python) that the simulator has no instruction
        for."""
        compute = sum(self.compute[k] * n for k, n in self.counts.items())
        own = self.busy_s - self.optimizer_s - sum(self.loads.values())
        return own / compute if compute > 0 else 1.0


def _step_spans(report: dict[str, Any], step: int) -> list[dict[str, Any]]:
    start, end = report["step_times"][str(step)]
    return [sp for sp in report["spans"] if start <= sp["start_s"] and sp["end_s"] <= end]


def _steps(reports: list[dict[str, Any]], warmup: int) -> list[int]:
    return sorted(int(k) for k in reports[0]["step_times"])[warmup:]


def rank_costs(reports: list[dict[str, Any]], warmup: int, solo: bool = False) -> list[RankCosts]:
    """Per rank: busy time, optimizer step and compute spans. A wait is a receive's (or allreduce's) span less
    what the call costs when its data is already there, the rank's 10th percentile of those spans. `solo`: what they
    cost on a core of the rank's own, every span less the time the rank was runnable but had no core
    (`Span.queued_s`), and the busy time less that of its spans outside the waits."""
    costs = []
    for r in reports:
        floor = _receive_floor(r)
        busy, optimizer, spans, queued = [], [], [], []
        loads: dict[int, list[float]] = {}
        for k in _steps(reports, warmup):
            start, end = r["step_times"][str(k)]
            step = _step_spans(r, k)
            waits = [(max(0.0, sp["end_s"] - sp["start_s"] - floor), _queued(sp)) for sp in step if sp["kind"] in WAITS]
            held_up = sum(_queued(sp) for sp in step if sp["kind"] not in WAITS) if solo else 0.0
            busy.append(end - start - sum(w for w, _ in waits) - held_up)
            queued.append(sum(min(w, q) for w, q in waits))
            optimizer.append(sum(_length(sp, solo) for sp in step if sp["kind"] == "optimizer_step"))
            spans.append([sp for sp in step if sp["kind"] in COMPUTE])
            for sp in step:
                if sp["kind"] == "load_microbatch":
                    loads.setdefault(sp["index"], []).append(_length(sp, solo))
        durations: dict[tuple[str, str], list[float]] = {}
        for sp in (sp for step in spans for sp in step):
            durations.setdefault((sp["kind"], sp["stage"]), []).append(_length(sp, solo))
        counts = {key: len(v) // len(spans) for key, v in durations.items()}
        compute = {key: median(v) for key, v in durations.items()}
        load_s = {index: median(v) for index, v in loads.items()}
        costs.append(RankCosts(median(busy), median(optimizer), compute, counts, median(queued), load_s, tuple(busy)))
    return costs


def _queued(span: dict[str, Any]) -> float:
    return float(span.get("queued_s") or 0.0)


def _length(span: dict[str, Any], solo: bool) -> float:
    """A span's length; `solo`: less the time its rank waited for a core in it."""
    return span["end_s"] - span["start_s"] - (_queued(span) if solo else 0.0)


def _receive_floor(report: dict[str, Any]) -> float:
    """What a receive (or allreduce) costs the rank when its data is already there: its 10th-percentile span
    (`host_time.receive_floor`, the figure `dapple calibrate` reads the runtime's host time with)."""
    from dapple_ir.backends.torch.host_time import receive_floor

    return receive_floor(report)


def waiting_shares(reports: list[dict[str, Any]], warmup: int, costs: list[RankCosts]) -> list[float]:
    """Per rank: the share of the step period (`step_seconds`) it spent waiting for other ranks."""
    period = step_seconds(reports, warmup)
    return [max(0.0, 1.0 - c.busy_s / period) for c in costs]


def cpu_shares(reports: list[dict[str, Any]], warmup: int, costs: list[RankCosts]) -> list[float]:
    """Per rank: the share of the step period it waited for a CPU within its waits (part of `waiting_shares`)."""
    period = step_seconds(reports, warmup)
    return [c.queued_s / period for c in costs]


@dataclass(frozen=True)
class Transfer:
    """One measured transfer: from the later of the send's issue (the sender's next non-send instruction, which
    hands queued sends to the transport) and its receive's post (the instruction `peak_memory.recv_posts` posts it
    before) to the receive's end, when the receiver waited for it; else to the receive's start, which it beat. A
    receive posted after its send was issued is answered by the sender's transport thread once the span of its
    own work (`HOLDING`) the sender runs at the post is done (`simulator._Simulator.answered_s`): the transfer
    starts there."""

    nbytes: float
    seconds: float
    landed: bool
    """Whether the receiver waited for the data (it was waiting when the transfer started, or its receive span is
    over twice the rank's floor): then `seconds` is exact; else the data was there first, `seconds` a bound."""
    idle: bool
    """Whether the receiver was already waiting when the send was issued (so both ends had a core for it)."""
    before_s: float
    """From the transfer's start to its receive's start: what of it the receiver spent elsewhere."""
    busy_s: float
    """Of `before_s`, the receiver's busy time: outside its receives and allreduces."""
    step: int
    rank: int
    """The sender."""
    index: int
    """The send's index in the sender's program."""
    queued_s: float = 0.0
    """Of `seconds`, the time the receiver was runnable but had no core (its receive's `Span.queued_s`, where it
    waited for the data): not the link's, the host's (`wake_overhead`)."""


def transfers(module: Any, reports: list[dict[str, Any]], warmup: int) -> list[Transfer]:
    """Every transfer of the steps after warm-up whose send and receive were both timed."""
    from dapple_ir.analysis.peak_memory import recv_posts, transfer_bytes

    posts = [recv_posts(module, program) for program in module.programs]
    floors = {r["rank"]: _receive_floor(r) for r in reports}
    found = []
    for k in _steps(reports, warmup):
        arrived: dict[tuple[Any, ...], tuple[dict[str, Any], float]] = {}
        waits: dict[int, list[tuple[float, float]]] = {}
        for r in reports:
            instrs = module.programs[r["rank"]].instrs
            step = _step_spans(r, k)
            waits[r["rank"]] = [(sp["start_s"], sp["end_s"]) for sp in step if sp["kind"] in WAITS]
            by_index = {sp["index"]: sp for sp in step}
            for sp in step:
                if sp["kind"] != "recv":
                    continue
                instr = instrs[sp["index"]]
                # Posted early: with the first non-send instruction from its post point on (`Runtime._issue`).
                at = posts[r["rank"]].get(sp["index"], sp["index"])
                while at in by_index and by_index[at]["kind"] == "send":
                    at += 1
                posted = by_index[at]["start_s"] if at in by_index else sp["start_s"]
                arrived[(instr.value, instr.grad, instr.mb, instr.rows, sp["peer"], r["rank"])] = (sp, posted)
        for r in reports:
            instrs = module.programs[r["rank"]].instrs
            step = sorted(_step_spans(r, k), key=lambda sp: sp["start_s"])
            for i, sp in enumerate(step):
                if sp["kind"] != "send":
                    continue
                instr = instrs[sp["index"]]
                got = arrived.get((instr.value, instr.grad, instr.mb, instr.rows, r["rank"], sp["peer"]))
                issue = next((later["start_s"] for later in step[i + 1 :] if later["kind"] != "send"), None)
                if got is None or issue is None:
                    continue
                recv, posted = got
                begin = max(issue, posted)
                if posted > issue:  # the sender's transport answers once its rank's own work lets it
                    begin = next(
                        (
                            later["end_s"]
                            for later in step[i + 1 :]
                            if later["kind"] in HOLDING and later["start_s"] <= posted < later["end_s"]
                        ),
                        begin,
                    )
                if recv["end_s"] < begin:
                    continue
                idle = recv["start_s"] <= issue  # and so posted <= issue = begin
                landed = idle or blocked(recv, floors[sp["peer"]])
                seconds = recv["end_s"] - begin if landed else max(0.0, recv["start_s"] - begin)
                nbytes = transfer_bytes(module, instr.value, instr.rows)
                before = max(0.0, recv["start_s"] - begin)
                away = sum(max(0.0, min(b, recv["start_s"]) - max(a, begin)) for a, b in waits[sp["peer"]])
                queued = min(_queued(recv), seconds) if landed else 0.0
                found.append(
                    Transfer(nbytes, seconds, landed, idle, before, before - away, k, r["rank"], sp["index"], queued)
                )
    return found


def busy_receive_slowdown(found: list[Transfer], link: Link) -> float:
    """How many times slower a transfer moves while its receiver is busy (`DeviceKind.busy_receive_slowdown`),
    fitted to the transfers that began while it was. In the simulator's model such a transfer moves at full speed
    (`link`'s time for its bytes) while the receiver waits and `slowdown` times slower while it is busy, so the
    receiver, reaching its receive after `before_s`, waits `max(0, link time - idle - busy / slowdown)`. The fit is
    the slowdown at which those waits add up to the measured ones (zero where the data came first); at least 1,
    at most `MAX_BUSY_RECEIVE_SLOWDOWN` (where even transfers that stop while the receiver is busy would wait less)."""
    began_busy = [t for t in found if not t.idle and t.busy_s > 0]
    # The woken receiver's wait for a core is the host's (`wake_overhead`), not the transfer's.
    measured = sum(max(0.0, t.seconds - t.before_s - t.queued_s) for t in began_busy if t.landed)

    def waits(slowdown: float) -> float:
        return sum(
            max(0.0, link.transfer_s(t.nbytes) - (t.before_s - t.busy_s) - t.busy_s / slowdown) for t in began_busy
        )

    if waits(1.0) >= measured:
        return 1.0
    if waits(MAX_BUSY_RECEIVE_SLOWDOWN) <= measured:
        return MAX_BUSY_RECEIVE_SLOWDOWN
    low, high = 1.0, MAX_BUSY_RECEIVE_SLOWDOWN
    for _ in range(60):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if waits(mid) < measured else (low, mid)
    return math.sqrt(low * high)


def link_samples(found: list[Transfer]) -> list[tuple[float, float]]:
    """(bytes, seconds) of the transfers whose receiver was already waiting, less its wait for a core once the data
    had come (`wake_overhead` prices that): what `fitted_link` (`calibration_fits.fit_link`) fits the link to."""
    return [(t.nbytes, t.seconds - t.queued_s) for t in found if t.idle]


def wake_overhead(reports: list[dict[str, Any]], warmup: int) -> float:
    """`DeviceKind.wake_overhead` as the run measured it, fitted as `dapple calibrate` fits it: the mean run-queue
    delay of the waits that blocked (`host_time.wake_delays`, `calibration_fits.fit_wake`) over every rank."""
    return fit_wake([d for r in reports for d in wake_delays(r, warmup)])


def simulated_waiting(
    plan_dir: Path, costs: list[RankCosts], links: list[tuple[Link, float, float]], cores: int = 0
) -> list[tuple[list[float], float]]:
    """Per (link, slowdown, wake), the simulator's idle per rank and its iteration for the plan with what was
    measured: each stage's compute its median span times its rank's `work_factor` (so a rank's simulated work per
    step is its measured busy time), a zero-bubble stage's backward split between its input and weight passes as
    measured, each rank's optimizer step its measured median, every transfer that link, slowed that much while its
    receiver is busy (`busy_receive_slowdown`), a rank that blocked going on `wake` seconds after it may
    (`wake_overhead`); with `cores`, the ranks share that many cores (`ClusterSpec.cores_per_node`: then `costs` are
    best each on a core of its own, `rank_costs(..., solo=True)`). The costs are set up once for all the pairs."""
    from dapple_ir.analysis.memory import batch_scale
    from dapple_ir.ir import InstrKind
    from dapple_ir.sim.simulator import simulate

    module = parse_module((plan_dir / "plan.dapple").read_text(), str(plan_dir / "plan.dapple"))
    scale = batch_scale(module)
    fractions: dict[str, float] = {}  # each zero-bubble stage's measured input-pass share of its backward
    for c in costs:
        for stage in {module.stage(stage) for _, stage in c.compute}:
            fwd, b_in, b_w, bwd = (
                c.compute.get((kind, stage.name), 0.0) * c.work_factor
                for kind in ("forward", "backward_input", "backward_weight", "backward")
            )
            if b_in + b_w > 0:
                fractions[stage.name] = b_in / (b_in + b_w)
                bwd = b_in + b_w
            # Spread the time over the stage's ops in proportion to their modelled cost.
            for attr, total in (("fwd_s", fwd), ("bwd_s", bwd)):
                modelled = sum(getattr(op.attrs, attr) or 0.0 for op in stage.ops) * scale
                for op in stage.ops:
                    own = getattr(op.attrs, attr) or 0.0
                    setattr(op.attrs, attr, own * total / modelled if modelled > 0 else total / scale / len(stage.ops))
    # Each rank's optimizer step and loads take their measured times, given as the instructions' durations.
    steps = {
        (r, next(i for i, ins in enumerate(p.instrs) if ins.kind is InstrKind.OPTIMIZER_STEP)): c.optimizer_s
        for r, (p, c) in enumerate(zip(module.programs, costs, strict=True))
    }
    steps.update({(r, index): seconds for r, c in enumerate(costs) for index, seconds in c.loads.items()})
    found = []
    for link, slowdown, wake in links:
        cluster = _measured_cluster(len(costs), link, slowdown, cores, wake)
        result = simulate(module, cluster=cluster, backward_input_fraction=fractions, durations=steps, steady=True)
        found.append((list(result.bubble_fraction), result.iteration_s))
    return found


def step_durations(reports: list[dict[str, Any]], warmup: int) -> list[dict[tuple[int, int], float]]:
    """Per measured step after warm-up: (rank, index) -> seconds of each forward, backward, optimizer step, load
    and free (`REPLAYED`), its span plus the rank's own work since the previous one (sends handed over, a receive's
    cost when its data is there, Python between calls); a step's tail goes to its last."""
    floors = [_receive_floor(r) for r in reports]
    steps = []
    for k in _steps(reports, warmup):
        durations: dict[tuple[int, int], float] = {}
        for rank, (r, floor) in enumerate(zip(reports, floors, strict=True)):
            start, end = r["step_times"][str(k)]
            clock, carry, last = start, 0.0, None
            for sp in sorted(_step_spans(r, k), key=lambda sp: sp["start_s"]):
                length = sp["end_s"] - sp["start_s"]
                carry += max(0.0, sp["start_s"] - clock) + (min(length, floor) if sp["kind"] in WAITS else length)
                clock = sp["end_s"]
                if sp["kind"] in REPLAYED:
                    last = (rank, sp["index"])
                    durations[last], carry = carry, 0.0
            if last is not None:
                durations[last] += carry + max(0.0, end - clock)
        steps.append(durations)
    return steps


def with_transfers(
    steps: list[dict[tuple[int, int], float]], found: list[Transfer], reports: list[dict[str, Any]], warmup: int
) -> list[dict[tuple[int, int], float]]:
    """`step_durations`'s steps, each with its transfers' measured times (`transfers`) by (sender, send index): the
    simulator replays a send so (`simulate`'s `durations`). A transfer whose data came before its receive keeps its
    bound: landing when the receive started, it costs the receiver nothing, as measured."""
    timed: dict[int, dict[tuple[int, int], float]] = {}
    for t in found:
        timed.setdefault(t.step, {})[(t.rank, t.index)] = t.seconds
    return [{**durations, **timed.get(k, {})} for k, durations in zip(_steps(reports, warmup), steps, strict=True)]


def replayed_waiting(
    module: Any, steps: list[dict[tuple[int, int], float]], link: Link, slowdown: float = 1.0, wake: float = 0.0
) -> list[float]:
    """Per rank, the simulator's waiting share when it replays each of the measured `steps` (`step_durations`),
    every transfer `link`, read as a measurement reads it: 1 - the median of the rank's busy time over the steps /
    the median iteration. (The median of each step's share, as this read before, is another statistic: on the GPT
    on 2 ranks with zb-h1 it gave 7/14 % where the measurement's way gives 8.5/15.7 %, from the same replays.)
    Waiting left unexplained by the plan's dependencies and the ranks' measured work shows as a gap."""
    from dapple_ir.sim.simulator import simulate_each

    cluster = _measured_cluster(len(module.programs), link, slowdown, wake=wake)
    results = list(simulate_each(module, steps, cluster=cluster, steady=True))
    iteration = median([result.iteration_s for result in results])
    busy = [median([result.busy_s[r] for result in results]) for r in range(len(module.programs))]
    return [max(0.0, 1.0 - b / iteration) if iteration > 0 else 0.0 for b in busy]


#: Draws of `spread_waiting`'s simulation per run.
SPREAD_DRAWS = 31


def spread_waiting(
    module: Any, steps: list[dict[tuple[int, int], float]], link: Link, slowdown: float = 1.0, wake: float = 0.0
) -> list[float]:
    """Per rank, the simulator's waiting with each instruction's time drawn independently from its times over the
    measured `steps` (`dapple_ir.sim.spread`): a prediction from the spread of the costs, where the replay keeps
    each step's own combination of them."""
    from dapple_ir.sim.spread import simulate_spread

    samples: dict[tuple[int, int], list[float]] = {}
    for durations in steps:
        for key, seconds in durations.items():
            samples.setdefault(key, []).append(seconds)
    cluster = _measured_cluster(len(module.programs), link, slowdown, wake=wake)
    return simulate_spread(module, samples=samples, cluster=cluster, draws=SPREAD_DRAWS, steady=True).bubble_fraction


def _measured_cluster(ranks: int, link: Link, slowdown: float = 1.0, cores: int = 0, wake: float = 0.0) -> ClusterSpec:
    """One node of `ranks` devices, each with a port of its own on a switch of `link`s; a transfer into a busy rank
    `slowdown` times slower (`busy_receive_slowdown`); a rank that blocked going on `wake` seconds after it may
    (`wake_overhead`); with `cores`, the ranks share that many. Nothing costs time but what the bench gives it:
    compute and optimizer steps come as measured."""
    kind = DeviceKind(
        "measured", math.inf, {"f32": math.inf}, math.inf, busy_receive_slowdown=slowdown, wake_overhead=wake
    )
    return ClusterSpec((kind,), ranks, link, link, name="measured", cores_per_node=cores)


def case_name(cfg: Config) -> str:
    """The folder of a case's plan (and, with `--keep-runs`, of its stored runs)."""
    return f"{cfg.size}-{cfg.procs}-{cfg.schedule}"


def keep_case(folder: Path, plan_dir: Path, cuts: dict[str, str], runs: dict[str, Any]) -> None:
    """Store what `stored_case` reads back: the case's plan, torch's cuts and every side's rank reports, one list per
    run (`launch_case`). The case's configuration is `keep_bench`'s."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copytree(plan_dir, folder / "plan", dirs_exist_ok=True)
    (folder / "cuts.json").write_text(json.dumps(cuts))
    (folder / "runs.json").write_text(json.dumps(runs))


def stored_case(folder: Path) -> tuple[Path, dict[str, str], dict[str, Any]]:
    """(plan folder, cuts, runs) of a case `keep_case` stored, with a clear error naming what is missing."""
    for name in ("cuts.json", "runs.json", "plan/plan.dapple"):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name}: no stored run of this case (write one with --keep-runs)")
    cuts, runs = (json.loads((folder / name).read_text()) for name in ("cuts.json", "runs.json"))
    return folder / "plan", cuts, runs


def run_case(
    cfg: Config,
    pairs: int,
    work: Path,
    deadline: float,
    ablate: bool = False,
    calibrated: tuple[float, float] = (1.0, 0.0),
    keep: Path | None = None,
    stored: Path | None = None,
) -> dict[str, Any]:
    """Pairs of runs, ours then torch's (then, with `ablate`, ours without each of `ABLATIONS`' changes), and the
    figures; `calibrated` is what `dapple calibrate` measures for the case's ranks: (busy receiver's slowdown, a
    woken rank's wait for a core). `keep`: store the case's plan and runs in a folder of its own there
    (`keep_case`); `stored`: run nothing, take them from the folder `keep` wrote (`stored_case`: the figures are
    computed again, the simulations run again)."""
    if stored is not None:
        plan_dir, cuts, runs = stored_case(stored / case_name(cfg))
        ablate = all(side in runs for side in ABLATIONS)
    else:
        plan_dir = work / f"plan-{case_name(cfg)}"
        cuts = compile_plan(cfg, plan_dir)
        sides: dict[str, dict[str, Any]] = {"ours": {"plan": str(plan_dir)}, "torch": {"cuts": cuts}}
        if ablate:
            sides["bare"] = {"plan": str(plan_with_posts(plan_dir, "none"))}
            sides["tight"] = {"plan": str(plan_with_posts(plan_dir, "tight"))}
            sides["fresh"] = {"plan": str(plan_dir)}
            sides["unpinned"] = {"plan": str(plan_dir)}
        # A B C D, then D C B A, ...: every side of a pair sees the same background load; past the deadline the
        # case runs fewer pairs, never none.
        runs = launch_case(cfg, sides, pairs, deadline, work)
        if keep is not None:
            keep_case(keep / case_name(cfg), plan_dir, cuts, runs)
    ours, theirs = runs["ours"], runs["torch"]
    ours_s = [step_seconds(r, cfg.warmup) for r in ours]
    theirs_s = [step_seconds(r, cfg.warmup) for r in theirs]
    waits = idle_vs_bubble(plan_dir, ours, cfg.warmup, calibrated)
    waiting, simulated, sim_step = waits.measured, waits.simulated, waits.iteration_s
    result = {
        "cuts": cuts,
        "ours_sps": cfg.global_batch / median(ours_s),
        "torch_sps": cfg.global_batch / median(theirs_s),
        "ratio": median([t / o for o, t in zip(ours_s, theirs_s, strict=True)]),
        "pairs": len(ours),
        "waiting": waiting,
        "error": waits.error,
        "step_spread": median([step_spread(r, cfg.warmup) for r in ours]),
        "simulated": simulated,
        "replayed": waits.replayed,
        "reconstructed": waits.reconstructed,
        "spread": waits.spread,
        "plain": waits.plain,
        "slowdown": waits.slowdown,
        "calibrated": waits.calibrated,
        "cpu": waits.cpu,
        "peer": waits.peer,
        "shared": waits.shared,
        "without_wake": waits.without_wake,
        "wake": waits.wake,
        "shared_over_measured": waits.shared_iteration_s / median(ours_s),
        "sim_over_measured": sim_step / median(ours_s),
        "ours_held": [max(run[r]["peak_bytes"] for run in ours) for r in range(cfg.procs)],
        "torch_held": [max(run[r]["peak_bytes"] for run in theirs) for r in range(cfg.procs)],
        "ours_rss": [median([run[r]["maxrss_bytes"] for run in ours]) for r in range(cfg.procs)],
        "torch_rss": [median([run[r]["maxrss_bytes"] for run in theirs]) for r in range(cfg.procs)],
        "buffers_reused": [reused_share(rank["recv_buffers"]) for rank in ours[0]],
        "ours_loss": first_loss(ours[0]),
        "torch_loss": first_loss(theirs[0]),
    }
    if ablate:
        result["ablation"] = {"sps": cfg.global_batch / median(ours_s), "waiting": waiting}
        for side in ABLATIONS:
            side_s = [step_seconds(r, cfg.warmup) for r in runs[side]]
            result["ablation"][side] = {
                "sps": cfg.global_batch / median(side_s),
                "gain": median([b / o for o, b in zip(ours_s, side_s, strict=True)]),
                "waiting": measured_waiting(runs[side], cfg.warmup),
                "loss_equal": first_loss(ours[0]) == first_loss(runs[side][0]),
            }
    return result


@dataclass(frozen=True)
class Waiting:
    """Per rank, medians over the runs: the measured share of the step spent waiting for other ranks, the
    simulator's for the plan with each run's median costs (`simulated_waiting`), and the simulator's replaying each
    measured step (`replayed_waiting`); and the simulated iteration at median costs. Every simulation but `plain`
    slows a transfer into a busy receiver by the run's fitted `busy_receive_slowdown`."""

    measured: list[float]
    simulated: list[float]
    replayed: list[float]
    iteration_s: float
    cpu: list[float]
    """Of `measured`, the share the rank waited for a CPU (`cpu_shares`): its data was there, a core was not."""
    spread: list[float]
    """The simulator's with each instruction's time drawn from its measured ones (`spread_waiting`)."""
    plain: list[float]
    """`simulated` with transfers that move as fast into a busy receiver as into a waiting one."""
    reconstructed: list[float]
    """`replayed` with every transfer its measured time too (`with_transfers`)."""
    slowdown: float
    """The median over the runs of the fitted `busy_receive_slowdown`."""
    calibrated: list[float]
    """`simulated` with `dapple calibrate`'s slowdown in place of the fitted one."""
    peer: list[float]
    """`measured` less `cpu`: the share the rank waited for another rank's data, not for a core."""
    shared: list[float]
    """The simulator's with each rank's costs on a core of its own (`rank_costs(..., solo=True)`) and the ranks
    sharing this machine's cores where they outnumber them (`ClusterSpec.cores_per_node`)."""
    shared_iteration_s: float
    without_wake: list[float]
    """`simulated` with a rank going on as soon as its data is there, whether or not it has a core."""
    wake: float
    """The median over the runs of the fitted `wake_overhead`."""
    error: list[float]
    """`measured`'s standard error from the sampling of the steps (`waiting_error`)."""


#: What `--keep-runs` stores beside the cases' folders: the cases in order, the pairs asked for and calibrate's figures.
KEPT_BENCH = "bench.json"


def keep_bench(
    folder: Path,
    cases: list[Config],
    pairs: int,
    slowdown: float,
    wakes: dict[int, float],
    noise: HostNoise | None = None,
) -> None:
    """Store what `stored_bench` reads back, before the cases run (each case's folder comes as it is done)."""
    folder.mkdir(parents=True, exist_ok=True)
    meta = {
        "cases": [asdict(cfg) for cfg in cases],
        "pairs": pairs,
        "slowdown": slowdown,
        "wakes": wakes,
        "noise": asdict(noise) if noise is not None else None,
    }
    (folder / KEPT_BENCH).write_text(json.dumps(meta))


def machine_noise(device: str, quick: bool) -> HostNoise | None:
    """The same work timed again and again on every core at once (`host_noise`), before the cases: the floor under
    every step this bench times (None on a GPU, whose steps it does not describe, or where it fails)."""
    if device != "cpu":
        return None
    try:
        return measure_host_noise(*((0.5, 0.01) if quick else (3.0, 0.05)))
    except Exception as exc:  # a note says it is missing; the cases still run
        print(f"host noise not measured: {str(exc).splitlines()[0]}", file=sys.stderr)
        return None


def stored_bench(folder: Path) -> tuple[list[Config], int, float, dict[int, float], HostNoise | None]:
    """(cases, pairs, calibrate's slowdown, calibrate's wake per rank count, the machine's noise) as `keep_bench`
    stored them; the noise is None where it was not measured (or the runs were stored before it was)."""
    path = folder / KEPT_BENCH
    if not path.is_file():
        raise SystemExit(f"--from-runs {folder}: no {KEPT_BENCH} there; store runs first with --keep-runs {folder}")
    meta = json.loads(path.read_text())
    wakes = {int(p): float(w) for p, w in meta["wakes"].items()}
    noise = HostNoise(**meta["noise"]) if meta.get("noise") else None
    return [Config(**cfg) for cfg in meta["cases"]], int(meta["pairs"]), float(meta["slowdown"]), wakes, noise


def calibrated_figures(device: str, procs: list[int]) -> tuple[float, dict[int, float]]:
    """What `dapple calibrate` measures on this machine before the cases, for a prediction no run informed: the
    busy receiver's slowdown (`measure_cpu_link`: 1 on a GPU) and, per rank count, a woken rank's wait for a core
    (`calibrate.measure_host_time`'s third figure; 0 where its run fails, or on a GPU)."""
    from dapple_ir.commands.calibrate import measure_host_time
    from dapple_ir.errors import RuntimeFailure
    from dapple_ir.frontend.measure import measure_cpu_link

    if device != "cpu":
        return 1.0, dict.fromkeys(procs, 0.0)
    wakes = {}
    for p in procs:
        try:
            wakes[p] = measure_host_time(device, p)[2]
        except RuntimeFailure as exc:
            print(f"calibrate's wake for {p} ranks not measured: {str(exc).splitlines()[0]}", file=sys.stderr)
            wakes[p] = 0.0
    return measure_cpu_link()[1], wakes


def idle_vs_bubble(
    plan_dir: Path, runs: list[list[dict[str, Any]]], warmup: int, calibrated: tuple[float, float] = (1.0, 0.0)
) -> Waiting:
    module = parse_module((plan_dir / "plan.dapple").read_text(), str(plan_dir / "plan.dapple"))
    measured, simulated, replayed, spread, iterations, cpu, plain, reconstructed = [], [], [], [], [], [], [], []
    slowdowns, with_calibrated, peer, shared, shared_iterations = [], [], [], [], []
    without_wake: list[list[float]] = []
    wakes: list[float] = []
    cores = node_cores(len(module.programs))
    every_costs: list[list[RankCosts]] = []
    for reports in runs:
        costs = rank_costs(reports, warmup)
        every_costs.append(costs)
        measured.append(waiting_shares(reports, warmup, costs))
        cpu.append(cpu_shares(reports, warmup, costs))
        peer.append([max(0.0, m - c) for m, c in zip(measured[-1], cpu[-1], strict=True)])
        found = transfers(module, reports, warmup)
        link = fitted_link(link_samples(found))
        slowdown = busy_receive_slowdown(found, link)
        wake = wake_overhead(reports, warmup)
        (bubble, iteration), (unslowed, _), (calibrated_bubble, _), (unwoken, _) = simulated_waiting(
            plan_dir,
            costs,
            [(link, slowdown, wake), (link, 1.0, wake), (link, *calibrated), (link, slowdown, 0.0)],
        )
        without_wake.append(unwoken)
        wakes.append(wake)
        with_calibrated.append(calibrated_bubble)
        # Sharing the cores makes a rank that waits for one busy, not blocked: no wake there.
        ((on_cores, on_cores_s),) = simulated_waiting(
            plan_dir, rank_costs(reports, warmup, solo=True), [(link, slowdown, 0.0)], cores
        )
        shared.append(on_cores)
        shared_iterations.append(on_cores_s)
        simulated.append(bubble)
        plain.append(unslowed)
        slowdowns.append(slowdown)
        steps = step_durations(reports, warmup)
        replayed.append(replayed_waiting(module, steps, link, slowdown, wake))
        reconstructed.append(replayed_waiting(module, with_transfers(steps, found, reports, warmup), link))
        spread.append(spread_waiting(module, steps, link, slowdown, wake))
        iterations.append(iteration)
    return Waiting(
        _by_rank(measured),
        _by_rank(simulated),
        _by_rank(replayed),
        median(iterations),
        _by_rank(cpu),
        _by_rank(spread),
        _by_rank(plain),
        _by_rank(reconstructed),
        median(slowdowns),
        _by_rank(with_calibrated),
        _by_rank(peer),
        _by_rank(shared),
        median(shared_iterations),
        _by_rank(without_wake),
        median(wakes),
        waiting_error([step_periods(reports, warmup) for reports in runs], every_costs),
    )


def node_cores(ranks: int) -> int:
    """The cores `ranks` ranks of this machine share where they outnumber them, else 0 (`measure.shared_cores`, the
    figure `dapple calibrate` writes into a cluster file)."""
    from dapple_ir.frontend.measure import shared_cores

    return shared_cores("cpu", ranks)


def measured_waiting(runs: list[list[dict[str, Any]]], warmup: int) -> list[float]:
    """Per rank, the median over the runs of the measured share of the step spent waiting for other ranks."""
    return _by_rank([waiting_shares(reports, warmup, rank_costs(reports, warmup)) for reports in runs])


#: The headline's name for `resolved_gap`'s test of the median-cost simulation.
RESOLVED = "median-cost, or within 2 standard errors of the measurement where it cannot resolve 15 %,"

#: Resamples of `waiting_error`'s bootstrap.
BOOTSTRAP_DRAWS = 200


def waiting_error(
    periods: list[list[float]], costs: list[list[RankCosts]], draws: int = BOOTSTRAP_DRAWS
) -> list[float]:
    """Per rank, the standard error of `measured_waiting` from the sampling of the steps, given each run's step
    periods (`step_periods`) and its ranks' costs (`rank_costs`, whose `busy_steps` line up with them): its
    standard deviation over `draws` bootstrap resamples of every run's steps after warm-up (each resample draws a
    run's steps with replacement and takes its medians again; a step's period and its ranks' busy times are drawn
    together, since they come together). What the measurement itself cannot resolve: a simulation that misses by
    less is not told apart from one that hits. Seeded, so the same runs give the same figure."""
    rng = random.Random(0)
    resampled: list[list[float]] = [[] for _ in costs[0]]
    for _ in range(draws):
        shares = []
        for run_periods, run_costs in zip(periods, costs, strict=True):
            pick = [rng.randrange(len(run_periods)) for _ in run_periods]
            period = median([run_periods[i] for i in pick])
            shares.append([max(0.0, 1.0 - median([c.busy_steps[i] for i in pick]) / period) for c in run_costs])
        for rank, share in enumerate(_by_rank(shares)):
            resampled[rank].append(share)
    return [statistics.pstdev(values) for values in resampled]


def _by_rank(shares: list[list[float]]) -> list[float]:
    """Per rank, the median of its share over the runs."""
    return [median([m[r] for m in shares]) for r in range(len(shares[0]))]


def resolved_gap(measured: list[float], predicted: list[float], error: list[float]) -> tuple[float, bool]:
    """The largest per-rank gap between measured and predicted waiting in standard errors of the measurement
    (`waiting_error`; infinite where a rank's is 0 and the gap is not), and whether every rank is within 15 % of
    its prediction or, where the measurement cannot resolve 15 %, within 2 standard errors of it."""
    gaps = [abs(m - p) for m, p in zip(measured, predicted, strict=True)]
    errors = [g / e if e > 0 else (math.inf if g > 0 else 0.0) for g, e in zip(gaps, error, strict=True)]
    ok = all(g <= 0.15 * p or g <= 2 * e for g, p, e in zip(gaps, predicted, error, strict=True))
    return max(errors), ok


def worst_gap(measured: list[float], predicted: list[float]) -> tuple[float, float]:
    """The largest per-rank gap between measured and predicted waiting shares: in points, and relative to the
    prediction (the rank with the largest relative gap; infinite where a rank is predicted no waiting but waits)."""
    gaps = [abs(m - p) for m, p in zip(measured, predicted, strict=True)]
    relative = [g / p if p > 0 else (math.inf if g > 0 else 0.0) for g, p in zip(gaps, predicted, strict=True)]
    return max(gaps), max(relative)


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
    parser.add_argument(
        "--schedules", nargs="+", default=list(VIRTUAL), choices=list(VIRTUAL), help="schedules to compare (full run)"
    )
    parser.add_argument("--models", nargs="+", default=["bench", "gpt"], choices=["bench", "gpt"], help="(full run)")
    parser.add_argument("--mlp-steps", type=int, default=90, help="steps per run on the MLP, warm-up included")
    parser.add_argument("--gpt-steps", type=int, default=8, help="steps per run on the GPT, warm-up included")
    parser.add_argument(
        "--keep-runs",
        type=Path,
        help="also store each case's plan and runs (every side's rank reports) here, a folder per case, for "
        "--from-runs (tens of MB a case)",
    )
    parser.add_argument(
        "--from-runs",
        type=Path,
        help="run nothing: the tables from the runs --keep-runs stored there, every figure and simulation computed "
        "again (to try a change to the analysis or the simulator on the same runs)",
    )
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--payload", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.keep_runs is not None and args.from_runs is not None:
        parser.error("--keep-runs and --from-runs: runs are either made and stored, or read back")
    if args.rank_worker:
        rank_pairs(json.loads(args.payload), Path(args.out))
        return 0

    if args.quick:
        cases = [
            Config("tiny", 2, "1f1b", 4, 32, steps=3, warmup=1),
            Config("gpt-tiny", 2, "zb-h1", 4, 16, steps=3, warmup=1),
        ]
        pairs = 1
        ablated = {("tiny", 2, "1f1b")}
    else:
        cases = [
            Config(size, p, s, m, batch, steps=steps, warmup=2, device=args.device, virtual=v)
            for size, batch, steps in (("bench", 256, args.mlp_steps), ("gpt", 32, args.gpt_steps))
            if size in args.models
            for p in args.procs
            for s, v in VIRTUAL.items()
            if s in args.schedules
            for m in [4 if size == "gpt" and p == 2 else 8]
        ]
        pairs = args.pairs
        ablated = ABLATED
    if args.from_runs is not None:
        cases, pairs, slowdown, wakes, noise = stored_bench(args.from_runs)
    else:
        slowdown, wakes = calibrated_figures(args.device, sorted({cfg.procs for cfg in cases}))
        noise = machine_noise(args.device, args.quick)
        if args.keep_runs is not None:
            keep_bench(args.keep_runs, cases, pairs, slowdown, wakes, noise)
    # The cases' budget starts after calibrate's runs (about 25 s), which took it from the first case's pairs.
    started = time.time()
    table = Table(
        "Our runtime vs torch.distributed.pipelining "
        + ("(CUDA, NCCL, one GPU per rank)" if args.device == "cuda" else "(CPU, gloo, 1 thread per rank)"),
        ["model", "procs", "schedule", "M", "ours samples/s", "torch samples/s", "speed-up (torch time / ours)",
         "ours waiting % per rank", "simulated waiting % per rank", "worst gap vs simulated (points)",
         "worst gap vs simulated (% of simulated)", "ours waiting's standard error (points per rank)",
         "worst gap vs simulated (standard errors)", "simulated / measured step",
         "busy receiver's slowdown (fitted)", "woken rank's wait for a core (fitted, us)",
         "simulated waiting % per rank, no wait for a core", "worst gap vs no wait for a core (%)",
         "simulated waiting % per rank, no slowdown",
         "worst gap vs no slowdown (%)", "worst gap vs calibrate's slowdown and wake (%)",
         "simulated with spread waiting % per rank", "worst gap vs spread (points)",
         "worst gap vs spread (% of spread)", "replayed waiting % per rank",
         "worst gap vs replay (points)", "worst gap vs replay (% of replayed)",
         "replayed with measured transfers waiting % per rank", "worst gap vs replay with measured transfers (%)",
         "ours waiting for a CPU % per rank", "ours waiting for a peer % per rank",
         "simulated on shared cores waiting % per rank",
         "worst gap vs shared cores (% of simulated, waiting for a peer)", "simulated on shared cores / measured step",
         "ours held MiB per rank", "torch held MiB per rank", "ours RSS MiB per rank", "torch RSS MiB per rank",
         "ours receives into a reused buffer % per rank",
         "step-0 loss ours", "step-0 loss torch", "pairs"],
    )  # fmt: skip
    ablation = Table(
        "What early receive posts, their headroom, reused receive buffers and pinned ranks buy (ours with "
        "every change vs ours without one)",
        ["model", "procs", "schedule", "M", "samples/s with all", "waiting % per rank with all",
         "samples/s without early posts", "speed-up from early posts (time without / with)",
         "waiting % per rank without early posts", "samples/s without post headroom",
         "speed-up from post headroom (time without / with)", "waiting % per rank without post headroom",
         "samples/s without reused buffers",
         "speed-up from reused buffers (time without / with)", "waiting % per rank without reused buffers",
         "samples/s unpinned",
         "speed-up from pinning (time unpinned / pinned)", "waiting % per rank unpinned", "same step-0 loss",
         "pairs"],
    )  # fmt: skip
    report = Report("runtime_vs_torch_pipelining", "Runtime: ours vs torch.distributed.pipelining", [table, ablation])
    ratios: list[float] = []
    fitted: list[float] = []  # each row's busy receiver's slowdown
    within: dict[str, list[bool]] = {}
    spreads: dict[str, list[float]] = {}  # per model, each row's `step_spread`
    # Each case's share of the budget is its share of the runs (an ablated case runs four sides per pair).
    weights = [2 + len(ABLATIONS) if (cfg.size, cfg.procs, cfg.schedule) in ablated else 2 for cfg in cases]
    with tempfile.TemporaryDirectory(prefix="dapple-bench-rt-") as tmp:
        for k, cfg in enumerate(cases):
            deadline = started + args.budget * sum(weights[: k + 1]) / sum(weights)
            try:
                if args.from_runs is None and time.time() >= started + args.budget:
                    # Past run_all's hard limit the section would be cut off, its last rows and headlines lost.
                    raise TimeoutError(f"the section's --budget of {args.budget:.0f} s was spent before the case began")
                r = run_case(
                    cfg, pairs, Path(tmp), deadline, ablate=weights[k] > 2, calibrated=(slowdown, wakes[cfg.procs]),
                    keep=args.keep_runs, stored=args.from_runs,
                )  # fmt: skip
            except Exception as exc:  # a missing part of the project must not sink the other rows
                reason = unavailable(str(exc).splitlines()[0][:200])
                table.add(
                    MODEL[cfg.size],
                    cfg.procs,
                    cfg.schedule,
                    cfg.microbatches,
                    reason,
                    *["-"] * (len(table.columns) - 5),
                )
                continue
            sim_gap, sim_rel = worst_gap(r["waiting"], r["simulated"])
            sim_errors, resolved = resolved_gap(r["waiting"], r["simulated"], r["error"])
            replay_gap, replay_rel = worst_gap(r["waiting"], r["replayed"])
            spread_gap, spread_rel = worst_gap(r["waiting"], r["spread"])
            plain_rel = worst_gap(r["waiting"], r["plain"])[1]
            unwoken_rel = worst_gap(r["waiting"], r["without_wake"])[1]
            calibrated_rel = worst_gap(r["waiting"], r["calibrated"])[1]
            rebuilt_rel = worst_gap(r["waiting"], r["reconstructed"])[1]
            shared_rel = worst_gap(r["peer"], r["shared"])[1]
            for name, rel in (
                ("median-cost", sim_rel),
                ("median-cost without the woken ranks' wait for a core", unwoken_rel),
                ("median-cost without the busy receivers' slowdown", plain_rel),
                ("median-cost with calibrate's slowdown and wake", calibrated_rel),
                ("spread", spread_rel),
                ("replay", replay_rel),
                ("replay with measured transfers", rebuilt_rel),
                ("on shared cores (against waiting for a peer)", shared_rel),
            ):
                within.setdefault(name, []).append(rel <= 0.15)
            within.setdefault(RESOLVED, []).append(resolved)
            spreads.setdefault(MODEL[cfg.size], []).append(r["step_spread"])
            table.add(
                MODEL[cfg.size], cfg.procs, cfg.schedule, cfg.microbatches, r["ours_sps"], r["torch_sps"], r["ratio"],
                _pct(r["waiting"]), _pct(r["simulated"]), 100 * sim_gap, 100 * sim_rel,
                "/".join(f"{100 * e:.1f}" for e in r["error"]), sim_errors, r["sim_over_measured"],
                r["slowdown"], 1e6 * r["wake"], _pct(r["without_wake"]), 100 * unwoken_rel,
                _pct(r["plain"]), 100 * plain_rel, 100 * calibrated_rel,
                _pct(r["spread"]), 100 * spread_gap, 100 * spread_rel,
                _pct(r["replayed"]), 100 * replay_gap, 100 * replay_rel,
                _pct(r["reconstructed"]), 100 * rebuilt_rel, _pct(r["cpu"]),
                _pct(r["peer"]), _pct(r["shared"]), 100 * shared_rel, r["shared_over_measured"],
                _mb(r["ours_held"]), _mb(r["torch_held"]), _mb(r["ours_rss"]), _mb(r["torch_rss"]),
                _pct(r["buffers_reused"]),
                r["ours_loss"], r["torch_loss"], r["pairs"],
            )  # fmt: skip
            if "ablation" in r:
                a = r["ablation"]
                each = [(a[side]["sps"], a[side]["gain"], _pct(a[side]["waiting"])) for side in ABLATIONS]
                same = all(a[side]["loss_equal"] for side in ABLATIONS)
                ablation.add(
                    MODEL[cfg.size], cfg.procs, cfg.schedule, cfg.microbatches, a["sps"], _pct(a["waiting"]),
                    *[x for three in each for x in three], "yes" if same else "NO", r["pairs"],
                )  # fmt: skip
            ratios.append(r["ratio"])
            fitted.append(r["slowdown"])
            report.headlines.append(
                f"{MODEL[cfg.size]} {cfg.procs} procs {cfg.schedule}: ours {r['ratio']:.2f}x the speed of "
                "torch.distributed.pipelining"
            )
            if args.json:
                report.save(args.json)  # what is done so far survives a hard stop at run_all's limit
    varied = ", ".join(f"{100 * min(v):.1f}-{100 * max(v):.1f} % on the {m}" for m, v in spreads.items()) or "-"
    if ratios:
        report.headlines.append(f"median speed-up {median(ratios):.2f}x, lowest {min(ratios):.2f}x")
        report.headlines.append(
            f"busy receiver's slowdown: fitted {min(fitted):.3g}-{max(fitted):.3g}x over the rows, "
            f"`dapple calibrate`'s measurement {slowdown:.3g}x"
        )
        report.headlines.append(
            "every rank's waiting within 15 % of the prediction: "
            + ", ".join(f"{name} simulation in {sum(ok)} of {len(ok)} rows" for name, ok in within.items())
        )
        if noise is not None:
            report.headlines.append(f"this machine's noise floor: {noise.summary()}; this run's steps: {varied}")
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    run_steps = {MODEL[cfg.size]: cfg.steps for cfg in cases}
    if args.from_runs is not None:
        table.notes.append("computed from stored runs (`--from-runs`): nothing ran for these tables.")
    table.notes += [
        f"`dapple calibrate`'s own measurements on this machine, taken before the cases: the busy receiver's "
        f"slowdown (a 256 KiB gloo transfer into a rank that waits, and into one that computes for 20 ms first) "
        f"{slowdown:.3g}x; a woken rank's wait for a core (`measure_host_time`'s run of a small MLP on that many "
        f"ranks, 1F1B) " + ", ".join(f"{wake * 1e6:.0f} us with {p} ranks" for p, wake in sorted(wakes.items())) + ".",
        "models: bench/bench_models.py: MLP width 512, 8 Linear layers (2.1M parameters), global batch 256; "
        "GPT-style d=256, 8 blocks, seq 64, 4 heads, vocabulary 512, global batch 32 (tiny sizes with --quick); SGD; "
        f"up to {pairs} A/B pair(s) per case (fewer past the budget: column 'pairs'), "
        + ", ".join(f"{steps} steps per run on the {model}" for model, steps in run_steps.items())
        + " (--mlp-steps, --gpt-steps), the first 2 steps (1 with --quick) dropped; "
        "medians. A case is one torchrun launch: its rank processes run ours, then torch's (then "
        "the ablation's: ours without early posts, ours without their headroom, ours without reused buffers, ours "
        "unpinned), pair "
        "after pair, in the reverse "
        "order every other pair, each run with a "
        "rendezvous of its own.",
        "stage split: the one our planner chose with --stages forced (interleaved: V = 2 stages per rank, stage k "
        "on rank k % ranks); torch's pipeline() splits at the same ops. Where our cut falls between plain ops, "
        "which pipeline() cannot split, the plan is compiled again with its layers coarsened to the model's "
        "top-level modules (the GPT's interleaved rows). zb-h1 on the torch side: ScheduleInterleavedZeroBubble "
        "with one stage per rank; a stage output that is a view (a Linear's output on a 3-D input) is copied "
        "there, since torch's zero-bubble backward detaches outputs in place and fails on views. interleaved on "
        "the torch side: ScheduleInterleaved1F1B.",
        "waiting (both sides alike) = share of the step period a rank spends waiting for other ranks; everything "
        "else it does is busy: compute, the optimizer step and the host's own work (issuing sends, posting "
        "receives, loads, frees, the memory meter, Python between calls). Measured: period = median gap between "
        "the steps' ends (as samples/s), busy = the rank's own step less its waits, a wait being a receive's span "
        "less the rank's 10th-percentile receive span (what a receive costs when its data is there). Simulated: "
        "the simulator on the plan with what that run measured: each compute instruction its median span, scaled "
        "per rank so that the rank's simulated work equals its measured busy time (the host's work spread over its "
        "computations), each rank's optimizer step and each load its measured median (a load runs where it ran: "
        "the last stage's first, which makes the step's batch, while it waits for the first activation), every "
        "transfer latency + bytes/bandwidth "
        "fitted to the transfers whose receiver was already waiting (from the send's issue to the receive's end, "
        "less the time the woken receiver then waited for a core; least squares, so the mean cost at each size, a "
        "rank's waiting being a sum over transfers), slowed by the "
        "run's fitted busy receiver's slowdown while its receiver computes (below), each "
        "transfer moving once its receive is posted (the simulator's rendezvous, as gloo and NCCL do it; a send "
        "issued before its post leaves once the sender's transport thread answers the post's notice, after the "
        "computation, load or free its rank runs then: `_Simulator.answered_s`), and a "
        "rank that blocked going on the run's fitted wait for a core later (below). Every simulation here is of the "
        "steady state (`simulate(steady=True)`): steps back to back, each rank starting its next step where it "
        "ended this one, as the runtime does (no barrier between steps), so that a rank that ends early starts "
        "early; the period, from one step's end to the next on the last rank, is what the measurement's period "
        "is. (The first step, every rank starting at once, is 0-5 % longer on these rows: the MLP's zb-h1 on 2 "
        "ranks ends its last stage about 2 ms after the first.) "
        "Both then share each rank's busy time, so the gap is busy x (1/measured period - 1/simulated step): "
        "'simulated / measured step' says how much of it is the step time. What the simulator cannot see is "
        "variance: on 2 cores, the ranks and gloo's socket threads time-share (4 processes on 2 cores: half the "
        "ranks run at a time), so a compute span now and then takes several times its median and the peer "
        "waits; a simulator of median costs predicts the period of an undisturbed step, and waiting below it.",
        "simulated with spread: the simulator with each forward, backward and optimizer step drawn, independently, "
        f"from that instruction's measured times (as in the replay, below) over the run's steps, {SPREAD_DRAWS} "
        "draws (dapple_ir.sim.spread); waiting = 1 - median busy / median iteration, as measured. A prediction from "
        "the costs' spread: what a median-cost simulation misses on a noisy host, without the replay's knowledge of "
        "which costs came together in one step.",
        "busy receiver's slowdown: how many times slower a transfer moves while its receiver computes than while "
        "it waits (`DeviceKind.busy_receive_slowdown`; the simulator slows it during the receiver's own work: "
        "compute instructions, the optimizer step, loads and frees that take time). On this host every core "
        "computes while the ranks do, and gloo's socket threads wait for one: a transfer into a computing rank "
        "hardly moves until the rank reaches its receive. Fitted per run "
        "(`busy_receive_slowdown`) to the transfers that began while their receiver was busy (outside its receives "
        "and allreduces): the slowdown at "
        "which the waits the model gives them add up to the measured ones; 1000 is the fit's ceiling (the "
        "transfer stops). 'no slowdown' is the median-cost simulation without it, as the bench predicted before; "
        "'calibrate's slowdown and wake' the median-cost simulation with the figures `dapple calibrate` measured "
        "(note above) in place of the fits, a prediction whose slowdown and wake no run of the case informed; the "
        "spread and the replay use the fits too.",
        "replayed: the simulator replaying the measured steps back to back, in the order they ran "
        "(`simulate_each(..., steady=True)`): every forward, "
        "backward, optimizer step, load and free its own measured span plus the rank's work since its previous one "
        "(so work done before a receive is replayed before it, not after the wait), every "
        "transfer the fitted link; median over the steps. Its waiting is what the plan's dependencies make of the "
        "ranks' measured work, stalls included; measured waiting beyond it is time no dependency explains.",
        "replayed with measured transfers: the replay with every transfer its own measured time too (from the later "
        "of its send's issue and its receive's post to the receive's end where the receiver waited; a transfer "
        "whose data came first lands when its receive started: `with_transfers`, a send's entry in `simulate`'s "
        "durations). Nothing of the step is modelled any more: what is left between it and the measurement is the "
        "simulator's dependencies (program order, the rendezvous, early posts) and the step's edges, not its costs. "
        "Between this column and the replay lies what the link model misses.",
        "waiting for a CPU: of the measured waiting, the time the rank's thread was runnable but not running (Linux's "
        "run-queue delay, read around every instruction: `Span.queued_s`, backends/torch/run_queue.py): its data "
        "had come, a core had not. With more ranks than cores (4 ranks and gloo's threads on 2 cores) a woken "
        "rank waits for a core; on a machine with a core (or GPU) per rank this is near 0. It is part of what the "
        "simulator is compared with, not taken out, and the simulator prices it: the woken rank's wait for a core "
        "(`DeviceKind.wake_overhead`) is fitted per run as the mean run-queue delay of the receives that blocked "
        "(spans over twice the rank's floor), and the simulator adds it to every receive (and allreduce) where a "
        "rank blocked; the link's samples leave it out. The mean, since the delays add up over a step: most "
        "receives find a core at once, a few wait a scheduler slice. 'no wait for a core' is the median-cost "
        "simulation without it (the same link): what the term adds.",
        "simulated on shared cores: the median-cost simulation with the ranks sharing this machine's cores where "
        "they outnumber them (`ClusterSpec.cores_per_node`, which `dapple calibrate` writes; 4 ranks on 2 cores "
        "here, none shared with 2 ranks): each instruction its median span less the time its rank waited for a "
        "core in it, the busy time likewise (`rank_costs(..., solo=True)`), and the simulator running k ranks that "
        "compute at once at min(1, cores / k) of a core each. Sharing makes a rank that waits for a core busy, not "
        "idle, so it is compared with the waiting for a peer: the measured waiting less its waiting for a CPU. "
        "Its 'simulated / measured step' is the step it predicts: the median-cost simulation, whose ranks each have "
        "a core, cannot see that 4 ranks computing at once run at half speed.",
        "worst gap: over the ranks, |measured - predicted| waiting in points, and relative to the predicted "
        "waiting (issue 19 asks for 15 %).",
        "ours waiting's standard error: what the measurement itself resolves (`waiting_error`): the standard "
        f"deviation of the measured waiting over {BOOTSTRAP_DRAWS} bootstrap resamples of the runs' steps after "
        "warm-up, each resample taking the medians again (a step's period and its ranks' busy times drawn together). "
        f"The steps vary from one to the next (interquartile range over median, `step_spread`) by {varied} in this "
        "run; "
        + (
            f"the machine alone, measured before the cases (bench/host_noise.py): {noise.summary()}"
            if noise is not None
            else "the machine alone was not measured (bench/host_noise.py)"
        )
        + ". Where a rank waits a few % of a step that varies by more, the measurement cannot tell "
        "15 % of its waiting apart. 'worst gap vs simulated (standard errors)' is the gap in those units; the "
        "headline's 'within 2 standard errors' row counts a rank as within where its gap is within 15 % or within "
        "2 standard errors.",
        "held = parameters + gradients + optimizer state + saved activations (+ stored values on our side), "
        "peak over the run; RSS = peak resident set of the rank process during that run (Linux's VmHWM, reset "
        "before each run after the previous run's freed heap went back to the system; includes the ~300 MiB of "
        "torch itself).",
        f"load average (1, 5, 15 min) at the end: {load}.",
    ]
    ablation.notes += [
        "with all = the plan as compiled, receive buffers reused; without early posts = the same plan.dapple with "
        "rank files generated as if `peak_memory.recv_posts` marked nothing (no `rt.post_recv`: each receive goes "
        "out with the sends just before it, at its `recv`); without post headroom = the same plan.dapple with "
        "rank files posting early only where the buffer keeps the rank within the peak it has with every receive "
        "at its `recv` (`recv_posts(..., headroom=0)`, the rule before `peak_memory.post_headroom`; the last stage "
        "of 1F1B and ZB-H1 then posts few of its inputs early); without reused buffers = the plan as compiled, "
        "every receive into a new buffer (the worker's --fresh-buffers; `ReceiveBuffers`); unpinned = the plan as "
        "compiled, each rank wherever the OS puts it (the "
        "worker's --no-pin) where it now runs on a core of its own (`cores.pin_rank`: where the node has a core per "
        "rank, so the 2-rank cases here; 4 ranks on 2 cores run unpinned either way). All run inside each A/B pair "
        "of the table above; a speed-up is the "
        "median over pairs of (step time without / with).",
        "the other changes cannot be told apart on CPU/gloo, so they are not measured here: sends issued together "
        "(`Transport.exchange`) are one `batch_isend_irecv` group only on NCCL, on gloo a plain loop of isends "
        "either way; the single host read of the losses per step and the stream waits instead of host waits "
        "save device-to-host synchronisation, which does not exist on the CPU (a CPU tensor's `.item()` costs "
        "nothing to wait for). They show, if at all, in bench/device_check.sh's CUDA run.",
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
