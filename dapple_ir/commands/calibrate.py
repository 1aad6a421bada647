"""`dapple calibrate -o cluster.toml`: measure this machine and write a cluster spec for `--cluster`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from dapple_ir.cluster.spec import DEFAULT_LINKS, ClusterSpec, DeviceKind, Link
from dapple_ir.errors import DappleError
from dapple_ir.frontend.profiler import Timer

#: Matmul edge and bytes copied per device type: large enough to reach the steady rate, small enough
#: to finish in a second or two.
_MATMUL_N = {"cpu": 1024, "cuda": 8192}
_COPY_BYTES = {"cpu": 64 * 2**20, "cuda": 1024 * 2**20}
#: Efficiencies are clamped to this range: a class measured far below its roofline (tiny CPU ops
#: dominated by Python overhead) still gets a usable figure.
_EFFICIENCY_RANGE = (0.01, 1.0)


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "calibrate",
        help="measure this machine's FLOP/s and memory bandwidth; write a cluster TOML",
        description=(
            "Measure f32 matmul FLOP/s and memory bandwidth of this machine's device (and, with --fit, the "
            "fraction of the roofline each op class reaches in a `dapple profile` JSON), and write a cluster TOML "
            "for --cluster. On a CPU each device is a process with its share of the cores."
        ),
        epilog=(
            "example:\n  dapple profile examples/mlp.py:factory -o profile.json\n"
            "  dapple calibrate --device cpu --devices 2 --fit profile.json -o cluster.toml\n"
            "  dapple opt model.dapple -p annotate-cost --cluster cluster.toml"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--devices", type=int, help="devices (ranks) on this node (default: GPUs, or 1 on a CPU)")
    p.add_argument("--nodes", type=int, default=1, help="nodes like this one in the cluster (default: 1)")
    p.add_argument("--fit", metavar="PROFILE_JSON", help="fit per-op-class efficiency from a `dapple profile` JSON")
    p.add_argument("-o", "--output", required=True, help="cluster TOML to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    kind_name = "cuda" if args.device.startswith("cuda") else "cpu"
    if kind_name == "cuda" and not torch.cuda.is_available():
        raise DappleError("calibrate: --device cuda was asked for but torch sees no CUDA device")
    if args.nodes < 1:
        raise DappleError(f"calibrate: --nodes must be at least 1, not {args.nodes}")
    devices = args.devices or (torch.cuda.device_count() if kind_name == "cuda" else 1)
    if devices < 1:
        raise DappleError(f"calibrate: --devices must be at least 1, not {devices}")
    threads = torch.get_num_threads()
    if kind_name == "cpu":
        # Each CPU rank gets its share of the cores, so measure with that many threads.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))
    try:
        solo = measure_device(torch.device(args.device), kind_name, devices)
        # CPU ranks share the machine's cores, caches and memory: what a rank gets is measured while the
        # other ranks do the same work. The profile a fit reads was measured alone, so the fit uses `solo`.
        shared = kind_name == "cpu" and devices > 1
        kind = measure_device(torch.device(args.device), kind_name, devices, neighbours=devices - 1) if shared else solo
    finally:
        torch.set_num_threads(threads)
    intra, inter = DEFAULT_LINKS["cpu"] if kind_name == "cpu" else DEFAULT_LINKS["H100"]
    if shared:
        intra = measure_cpu_link()
    spec = ClusterSpec((kind,) * args.nodes, devices, intra, inter, name=f"calibrated {socket.gethostname()}")
    if args.fit:
        spec = ClusterSpec(
            spec.node_kinds, devices, intra, inter, name=spec.name, efficiency=fit_efficiency(args.fit, solo)
        )
    from dapple_ir.cluster.toml_file import cluster_to_toml

    Path(args.output).write_text(cluster_to_toml(spec))
    fitted = ", ".join(f"{k} {v:.2f}" for k, v in spec.efficiency.items()) or "defaults"
    alone = "" if kind is solo else f" ({solo.flops('f32') / 1e9:.1f} alone)"
    print(
        f"calibrate: {kind.name}: f32 {kind.flops('f32') / 1e9:.1f} GFLOP/s per rank{alone}, "
        f"memory {kind.mem_bandwidth / 1e9:.1f} GB/s, {kind.op_overhead * 1e6:.1f} us per op call, "
        f"{kind.memory_bytes / 1e9:.1f} GB per device; link {intra.bandwidth / 1e9:.2f} GB/s, "
        f"{intra.latency * 1e6:.0f} us; "
        f"efficiency: {fitted} -> {args.output}",
        file=sys.stderr,
    )
    return 0


def measure_device(device: Any, kind_name: str, devices: int = 1, neighbours: int = 0) -> DeviceKind:
    """Peak f32 matmul FLOP/s and copy bandwidth of `device`, measured; a CPU's memory shared by `devices`.

    With `neighbours`, that many threads run the same kind of work while each figure is taken.
    """
    import torch

    timer = Timer(device, repeats=3, warmup=1)
    n = _MATMUL_N[kind_name]
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    with _busy(neighbours, lambda _k: torch.mm(a, b)):
        flops = {"f32": 2 * n**3 / timer.time(lambda: torch.mm(a, b))}
    if kind_name == "cuda":
        for dtype, name in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
            ah, bh = a.to(dtype), b.to(dtype)
            flops[name] = 2 * n**3 / timer.time(partial(torch.mm, ah, bh))
    count = _COPY_BYTES[kind_name] // 4
    src = torch.empty(count, device=device).uniform_()
    dst = torch.empty_like(src)
    # A copy reads and writes every byte once; the neighbours copy buffers of their own.
    theirs = [(torch.empty_like(src), torch.empty_like(src)) for _ in range(neighbours)]
    with _busy(neighbours, lambda k: theirs[k][1].copy_(theirs[k][0])):
        bandwidth = 2 * count * 4 / timer.time(lambda: dst.copy_(src))
    memory = _memory_bytes(device) / (devices if kind_name == "cpu" else 1)
    step = _tiny_step(device)
    steps = [_tiny_step(device) for _ in range(neighbours)]
    with _busy(neighbours, lambda k: steps[k]()):
        # Each of the 16 Linears and the sum run once forward and once backward.
        overhead = timer.time(step) / (2 * (_TINY_DEPTH + 1))
    return DeviceKind(kind_name, memory, flops, bandwidth, op_overhead=overhead)


_TINY_DEPTH = 16
#: Message sizes of the link measurement: latency from the small one, bandwidth from the large one.
_PING_BYTES, _BULK_BYTES = 4, 16 * 2**20
_LINK_TIMEOUT_S = 120.0


def measure_cpu_link() -> Link:
    """gloo between two processes on this machine, as two CPU ranks talk: one-way latency and bandwidth.

    Two fresh processes (torch's spawn) bounce a 4-byte and a 16 MiB tensor back and forth; every wait is
    bounded, and a machine where they cannot meet keeps the default link with a note on stderr.
    """
    import torch.multiprocessing as mp

    from dapple_ir.backends.torch.launch import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_link_worker, args=(r, port, results), daemon=True) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        found = results.get(timeout=_LINK_TIMEOUT_S)
    except Exception:  # queue.Empty, or a worker that died before reporting
        found = None
    for proc in procs:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    if not isinstance(found, tuple):
        why = found or "no answer in time"
        print(f"calibrate: no gloo timing between two processes ({why}); keeping the default link", file=sys.stderr)
        return DEFAULT_LINKS["cpu"][0]
    ping_s, bulk_s = found
    latency = ping_s / 2
    return Link(_BULK_BYTES / max(bulk_s / 2 - latency, 1e-9), latency)


def _link_worker(rank: int, port: int, results: Any) -> None:
    """One end of the link measurement; rank 0 puts (round trip of the small message, of the large one)."""
    import datetime
    import time

    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
            timeout=datetime.timedelta(seconds=_LINK_TIMEOUT_S),
        )  # fmt: skip
        peer = 1 - rank

        def round_trip(nbytes: int) -> float:
            buf = torch.zeros(nbytes // 4)
            times = []
            for _ in range(7):
                start = time.perf_counter()
                if rank == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
                times.append(time.perf_counter() - start)
            return sorted(times[1:])[len(times[1:]) // 2]

        ping, bulk = round_trip(_PING_BYTES), round_trip(_BULK_BYTES)
        dist.destroy_process_group()
        if rank == 0:
            results.put((ping, bulk))
    except Exception as exc:
        if rank == 0:
            results.put(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


def _tiny_step(device: Any) -> Callable[[], None]:
    """A training step whose ops do almost no work: it times the per-call cost (dispatch, autograd, launch)."""
    import torch

    layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(_TINY_DEPTH)]).to(device)
    x = torch.randn(1, 4, device=device)

    def step() -> None:
        layers(x).sum().backward()

    return step


@contextmanager
def _busy(count: int, work: Callable[[int], object]) -> Iterator[None]:
    """Run `work(k)` in a loop on threads k = 0..count-1 (torch releases the GIL inside its ops) during the block."""
    stop = threading.Event()

    def loop(k: int) -> None:
        while not stop.is_set():
            work(k)

    threads = [threading.Thread(target=loop, args=(k,), daemon=True) for k in range(count)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()


def _memory_bytes(device: Any) -> float:
    import torch

    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def fit_efficiency(path: str, kind: DeviceKind) -> dict[str, float]:
    """Per op class: roofline seconds at full peak over measured seconds, summed over the class's ops.

    The device's per-call overhead is taken off the measured times first: efficiency describes the
    work an op does, the overhead its call. A profile that also timed the whole step (`step_s`) has
    its op times scaled to it first: an op timed alone carries call and synchronisation costs that
    the ops of a running step share, so the fitted model adds up to the step, not to the sum of parts.
    """
    from dapple_ir.passes.annotate_cost import roofline_times

    compute_only = dataclasses.replace(kind, op_overhead=0.0)

    try:
        profile: dict[str, Any] = json.loads(Path(path).read_text())
        ops: dict[str, dict[str, Any]] = profile["ops"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DappleError(f"calibrate: {path} is not a profile written by `dapple profile` ({exc})") from None
    summed = sum(float(e.get("fwd_s", 0.0)) + float(e.get("bwd_s", 0.0)) for e in ops.values())
    scale = float(profile["step_s"]) / summed if profile.get("step_s") and summed > 0 else 1.0
    ideal: dict[str, float] = {}
    measured: dict[str, float] = {}
    for entry in ops.values():
        if "op_class" not in entry or "mem_bytes" not in entry:
            continue
        flops = (float(entry.get("fwd_flops", 0.0)), float(entry.get("bwd_flops", 0.0)))
        fwd, bwd = roofline_times(flops, float(entry["mem_bytes"]), compute_only)
        if fwd + bwd <= 0:
            continue  # views: no work to be efficient at
        calls = (fwd > 0) + (bwd > 0)
        spent = (float(entry["fwd_s"]) + float(entry["bwd_s"])) * scale - calls * kind.op_overhead
        op_class = str(entry["op_class"])
        ideal[op_class] = ideal.get(op_class, 0.0) + fwd + bwd
        measured[op_class] = measured.get(op_class, 0.0) + max(spent, 1e-9)
    if not measured:
        raise DappleError(f"calibrate: {path} has no ops with FLOP counts to fit efficiencies from")
    lo, hi = _EFFICIENCY_RANGE
    return {c: round(min(hi, max(lo, ideal[c] / measured[c])), 4) for c in sorted(measured) if measured[c] > 0}
