"""Measuring this machine for `dapple calibrate`: matmul FLOP/s, memory bandwidth, the cost of one op
call, and the link between two CPU ranks (gloo between two processes), with how much slower a transfer
moves into a rank that computes than into one that waits (`DeviceKind.busy_receive_slowdown`).

On a CPU each device is a process with its share of the cores, and the ranks share the machine's
caches and memory: with several ranks, what one rank gets is measured while neighbours do the same
work, beside the figures of one rank alone (which a profile, measured alone, is fitted against).
A rank's matmul rate is the rate alone times the median over `_SHARED_ROUNDS` rounds of (alone /
shared) time, each round timing both back to back (`_shared_rate`): a prediction scales the profile
by that ratio, and two figures taken seconds apart on a shared machine put its drift into it (per rank
87-133 GFLOP/s against 114-147 alone, ratios 0.72-1.16, over seven calibrations on one 2-core VM).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from statistics import median
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dapple_ir.cluster.roofline import line_fit
from dapple_ir.cluster.spec import DEFAULT_LINKS, MAX_BUSY_RECEIVE_SLOWDOWN, ClusterSpec, DeviceKind, Link
from dapple_ir.cluster.topology import Network
from dapple_ir.errors import DappleError
from dapple_ir.frontend.profiler import Timer
from dapple_ir.pricing.collectives import allreduce_s

#: Rounds of the alone-then-shared matmul timing whose median ratio gives a CPU rank its share (`_shared_rate`).
_SHARED_ROUNDS = 7
#: Matmul edge and bytes copied per device type: large enough to reach the steady rate, small enough
#: to finish in a second or two.
_MATMUL_N = {"cpu": 1024, "cuda": 8192}
_COPY_BYTES = {"cpu": 64 * 2**20, "cuda": 1024 * 2**20}
_TINY_DEPTH = 16
#: Width and batches of the fixed-part fit (`_fixed_per_call`) per device type: work enough to leave
#: the launch-bound regime at the largest batch, weights small enough that reading them (a cost per
#: call that the roofline already counts) stays far below the launch, well under a second in all.
_FIT = {"cpu": (64, (1, 4, 16, 64)), "cuda": (512, (16, 64, 256, 1024))}
#: Message sizes of the link measurement: latency from the small one, bandwidth from the large one.
_PING_BYTES, _BULK_BYTES = 4, 16 * 2**20
#: Round trips of the small message (the first dropped, the median kept): a few milliseconds in all. With 7, one
#: calibration on a 2-core VM read 1845 us where the others read 90-140 us, and every pipelined plan it priced
#: was off by as much.
_PINGS = 61
_LINK_TIMEOUT_S = 120.0
#: The busy-receiver measurement: a message of this size (a pipeline's activation, a few hundred KiB) posted
#: before its receiver computes for `_BUSY_S`; `_BUSY_ROUNDS` rounds with the receiver waiting and as many with
#: it computing, medians kept; the slowdown at most `MAX_BUSY_RECEIVE_SLOWDOWN` (the transfer stopped meanwhile).
_BUSY_BYTES, _BUSY_S, _BUSY_ROUNDS = 256 * 2**10, 0.02, 15


@dataclass(frozen=True)
class NodeMeasurement:
    """What one node of the machine measured gives a cluster spec."""

    kind: DeviceKind
    """A device as one rank gets it while every rank works (on a CPU the ranks share the machine)."""
    solo: DeviceKind
    """A device measured alone (the same as `kind` where ranks do not share)."""
    devices: int
    """Devices (ranks) on the node."""
    intra_link: Link | None
    """The link between two ranks of the node, measured (None: not measured, keep the preset)."""
    cores: int = 0
    """The cores the node's ranks share where they outnumber them (`shared_cores`), else 0."""


def measure_node(device: str, devices: int | None) -> NodeMeasurement:
    """Measure `device` (`cpu` or `cuda[:N]`) as `devices` ranks (default: the GPUs, or 1 on a CPU) use it."""
    kind_name = "cuda" if device.startswith("cuda") else "cpu"
    if kind_name == "cuda" and not torch.cuda.is_available():
        raise DappleError("calibrate: --device cuda was asked for but torch sees no CUDA device")
    count = devices or (torch.cuda.device_count() if kind_name == "cuda" else 1)
    if count < 1:
        raise DappleError(f"calibrate: --devices must be at least 1, not {count}")
    cores = shared_cores(kind_name, count)
    # Ranks beyond the cores take turns, which the simulator models (`ClusterSpec.cores_per_node`): a rank is measured
    # as it computes while every core does, one rank per core, not time-sliced as well.
    working = min(count, cores) if cores else count
    with rank_threads(kind_name, count):
        solo = measure_device(torch.device(device), kind_name, count)
        kind = solo
        if kind_name == "cpu" and working > 1:
            share = _shared_rate(torch.device(device), kind_name, working - 1)
            flops = {k: v * share for k, v in solo.peak_flops.items()}
            kind = measure_device(torch.device(device), kind_name, count, neighbours=working - 1, flops=flops)
    if kind_name != "cpu" or count == 1:
        return NodeMeasurement(kind, solo, count, None, cores)
    link, slowdown, reduce = measure_cpu_link()
    kind = dataclasses.replace(kind, busy_receive_slowdown=slowdown, reduce_per_byte=reduce)
    return NodeMeasurement(kind, dataclasses.replace(solo, reduce_per_byte=reduce), count, link, cores)


def shared_cores(kind_name: str, devices: int) -> int:
    """The cores `devices` CPU ranks of this node share where they outnumber them (`ClusterSpec.cores_per_node`),
    else 0: a GPU rank, or a CPU rank with a core of its own, shares none. The cores are the ones this process may
    run on (taskset and cgroups respected), as `dapple run`'s ranks get them."""
    if kind_name != "cpu":
        return 0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return usable if usable < devices else 0


def measure_device(
    device: Any, kind_name: str, devices: int = 1, neighbours: int = 0, flops: dict[str, float] | None = None
) -> DeviceKind:
    """Peak f32 matmul FLOP/s and copy bandwidth of `device`, measured; a CPU's memory shared by `devices`.

    With `neighbours`, that many threads run the same kind of work while each figure is taken. With `flops`, the
    matmul rates are those (a shared CPU rank's: `_shared_rate`) and only the other figures are measured.
    """
    timer = Timer(device, repeats=3, warmup=1)
    if flops is None:
        n, a, b = _matmul_operands(device, kind_name)
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
        # Ops with real work at growing batches: what their time keeps as the batch shrinks is the
        # fixed part per call, the launch and (on a GPU) the floor of a kernel too small to fill it.
        fitted = _fixed_per_call(device, kind_name, timer)
    return DeviceKind(kind_name, memory, flops, bandwidth, op_overhead=max(overhead, fitted))


def measure_cpu_link() -> tuple[Link, float, float]:
    """gloo between two processes on this machine, as two CPU ranks talk: one-way latency and bandwidth, the
    busy receiver's slowdown (`DeviceKind.busy_receive_slowdown`) and the host's seconds per byte an allreduce
    member reduces (`DeviceKind.reduce_per_byte`).

    Two fresh processes (torch's spawn), each with half the cores, bounce a 4-byte and a 16 MiB tensor back and
    forth, and allreduce the 16 MiB tensor: what the allreduce takes beyond its ring on the measured link
    (`pricing.collectives.allreduce_s`: 16 MiB at its bandwidth and two latencies) is the hosts' reduction, per
    byte of the half each member reduces. Then the sender sends `_BUSY_BYTES` and computes, while the receiver, its
    receive posted, either waits (the transfer's time T) or first computes for D and then waits w: the transfer moved
    T - w while it computed, so it moves D / (T - w) times slower then. Every wait is bounded, and a machine where
    the processes cannot meet keeps the default link, no slowdown and no reduction price, with a note on stderr.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    threads = max(1, (os.cpu_count() or 2) // 2)
    procs = [ctx.Process(target=_link_worker, args=(r, port, results, threads), daemon=True) for r in range(2)]
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
        return DEFAULT_LINKS["cpu"][0], 1.0, 0.0
    ping_s, bulk_s, reduce_s, idle_s, busy_s, waited_s = found
    latency = ping_s / 2
    moved = idle_s - waited_s  # what of the transfer went through while the receiver computed
    top = MAX_BUSY_RECEIVE_SLOWDOWN
    slowdown = busy_s / moved if moved > busy_s / top else top
    link = Link(_BULK_BYTES / max(bulk_s / 2 - latency, 1e-9), latency)
    alone = DeviceKind("cpu", 0.0, {}, 0.0)  # no price of its own: the ring on the measured link only
    ring = allreduce_s(Network(ClusterSpec((alone,), 2, link, link)), _BULK_BYTES, [0, 1])
    return link, min(top, max(1.0, slowdown)), max(0.0, (reduce_s - ring) / (_BULK_BYTES / 2))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _link_worker(rank: int, port: int, results: Any, threads: int) -> None:
    """One end of the link measurement; rank 0 puts (round trip of the small message, of the large one, its
    allreduce, and from rank 1's busy-receiver rounds the median transfer into a waiting receiver, compute time and
    wait after it)."""
    try:
        torch.set_num_threads(threads)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
            timeout=datetime.timedelta(seconds=_LINK_TIMEOUT_S),
        )  # fmt: skip
        peer = 1 - rank

        def round_trip(nbytes: int, rounds: int) -> float:
            buf = torch.zeros(nbytes // 4)
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                if rank == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
                times.append(time.perf_counter() - start)
            return sorted(times[1:])[len(times[1:]) // 2]

        ping, bulk = round_trip(_PING_BYTES, _PINGS), round_trip(_BULK_BYTES, 7)
        reduce = _allreduce_s(_BULK_BYTES, 7)
        idle = _busy_receiver_rounds(rank, computes=False)
        busy = _busy_receiver_rounds(rank, computes=True)
        # Rank 1 timed the rounds; rank 0 reports.
        timed = torch.zeros(3)
        if rank == 1:
            waits, computed = [w for _, w in busy], [d for d, _ in busy]
            timed = torch.tensor([median(w for _, w in idle), median(computed), median(waits)])
            dist.send(timed, 0)
        else:
            dist.recv(timed, 1)
        dist.destroy_process_group()
        if rank == 0:
            results.put((ping, bulk, reduce, *(float(x) for x in timed)))
    except Exception as exc:
        if rank == 0:
            results.put(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")


def _allreduce_s(nbytes: int, rounds: int) -> float:
    """The median allreduce (sum) of `nbytes` of f32 over the group, the first round left out; each round starts
    from a barrier, so that neither member waits for the other in it."""
    buf = torch.ones(nbytes // 4)
    times = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - start)
    return median(times[1:])


def _busy_receiver_rounds(rank: int, computes: bool) -> list[tuple[float, float]]:
    """`_BUSY_ROUNDS` transfers of `_BUSY_BYTES` from rank 0, which computes after sending, to rank 1, which posts
    its receive and, if it `computes`, computes for `_BUSY_S` before it waits. Rank 1 returns per round (seconds
    it computed, seconds it then waited); rank 0 nothing. A 4-byte exchange starts each round on both ranks."""
    buf, token = torch.zeros(_BUSY_BYTES // 4), torch.zeros(1)
    a = torch.randn(256, 256)
    rounds = []

    def compute(seconds: float) -> None:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            torch.mm(a, a)

    for _ in range(_BUSY_ROUNDS):
        if rank == 0:
            dist.send(token, 1, tag=1)
            dist.recv(token, 1, tag=1)
            work = dist.isend(buf, 1, tag=2)
            assert work is not None  # a member of the group always gets its request
            compute(_BUSY_S)
            work.wait()
        else:
            work = dist.irecv(buf, 0, tag=2)  # posted first, as a pipeline posts early
            assert work is not None
            dist.recv(token, 0, tag=1)
            dist.send(token, 0, tag=1)
            start = time.perf_counter()
            if computes:
                compute(_BUSY_S)
            done = time.perf_counter()
            work.wait()
            rounds.append((done - start, time.perf_counter() - done))
    return rounds


def _tiny_step(device: Any) -> Callable[[], None]:
    """A training step whose ops do almost no work: it times the per-call cost (dispatch, autograd, launch)."""
    layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(_TINY_DEPTH)]).to(device)
    x = torch.randn(1, 4, device=device)

    def step() -> None:
        layers(x).sum().backward()

    return step


def _fixed_per_call(device: Any, kind_name: str, timer: Timer) -> float:
    """The intercept per op call of a training step's time over its batch (`roofline.line_fit`): a
    chain of `_TINY_DEPTH` Linears and a sum, stepped at the batches of `_FIT`."""
    width, batches = _FIT[kind_name]
    layers = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(_TINY_DEPTH)]).to(device)

    def step(x: Any) -> None:
        layers(x).sum().backward()

    points = [(float(b), timer.time(partial(step, torch.randn(b, width, device=device)))) for b in batches]
    intercept, _slope = line_fit(points)
    return max(0.0, intercept / (2 * (_TINY_DEPTH + 1)))


def _shared_rate(device: Any, kind_name: str, neighbours: int, rounds: int = _SHARED_ROUNDS) -> float:
    """The share of its matmul rate alone that a rank keeps while `neighbours` threads do the same work: the median
    over `rounds` of (time alone / time shared), each round timing the two back to back so that the machine's drift
    between them is small."""
    timer = Timer(device, repeats=3, warmup=1)
    _, a, b = _matmul_operands(device, kind_name)
    ratios = []
    for _ in range(rounds):
        alone = timer.time(lambda: torch.mm(a, b))
        with _busy(neighbours, lambda _k: torch.mm(a, b)):
            together = timer.time(lambda: torch.mm(a, b))
        ratios.append(alone / together)
    return median(ratios)


def _matmul_operands(device: Any, kind_name: str) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The edge and two random square operands of the matmul whose rate stands for the device's peak."""
    n = _MATMUL_N[kind_name]
    return n, torch.randn(n, n, device=device), torch.randn(n, n, device=device)


@contextmanager
def rank_threads(device_type: str, ranks: int) -> Iterator[None]:
    """During the block torch computes with one of `ranks` CPU ranks' share of the cores (a CPU rank measures
    what it gets); on a GPU, as it was. The thread count is restored after."""
    threads = torch.get_num_threads()
    if device_type != "cuda":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
