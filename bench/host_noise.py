"""How steady this machine's cores are: the same work, timed again and again on every core at once.

One process per core (at most `MAX_CORES`), each pinned to its core with one torch thread, runs the same fixed
piece of work (the bench MLP's forward and backward on one microbatch, repeated to about `--chunk-ms`) back to
back for `--seconds`, all cores at the same time, and times each piece. Nothing else of ours runs meanwhile. What
it reports is the floor under every timing the runtime bench takes here:

- spread: the interquartile range of a core's piece times over their median (the runtime bench's `step_spread`
  of a step that did exactly this work);
- lag-1 autocorrelation: how much a slow piece predicts a slow next one (speed drifting over several pieces);
- cross-core correlation: of the pieces' times on two cores, matched by when they ran (time bins of one piece);
  near 0 means each core slows on its own, so two pipeline ranks doing the same work still wait for each other.

    .venv/bin/python bench/host_noise.py [--seconds 4] [--chunk-ms 50]

The runtime bench (`runtime_vs_torch_pipelining.py`) runs it before its cases and quotes it in its notes.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

#: The most cores measured at once (one process each).
MAX_CORES = 8
#: Seconds a measuring process may take to start (spawn imports torch: 2-5 s) or to finish after its run.
_GRACE_S = 60.0


@dataclass(frozen=True)
class HostNoise:
    """What `measure_host_noise` found, per core and over the cores."""

    chunk_s: float
    """The median time of one piece of work (its length as asked, as it came out)."""
    spread: list[float]
    """Per core: interquartile range of its piece times over their median."""
    autocorrelation: list[float]
    """Per core: lag-1 autocorrelation of its piece times."""
    cross_correlation: float
    """Mean over pairs of cores of the correlation of their piece times in matching time bins (nan with one core)."""
    pieces: list[int]
    """Per core: how many pieces it timed."""

    def summary(self) -> str:
        spread = f"{100 * min(self.spread):.1f}-{100 * max(self.spread):.1f} %"
        auto = f"{min(self.autocorrelation):.2f}-{max(self.autocorrelation):.2f}"
        return (
            f"the same {1e3 * self.chunk_s:.0f} ms of work (the bench MLP's forward and backward, one thread per "
            f"core, {len(self.spread)} cores at once) varies by {spread} (interquartile range over median) from one "
            f"time to the next; lag-1 autocorrelation {auto}; correlation between cores {self.cross_correlation:.2f}"
        )


def _piece() -> Any:
    import torch

    torch.manual_seed(0)
    x = torch.randn(32, 512)
    weights = [torch.randn(512, 512, requires_grad=True) for _ in range(8)]

    def run() -> None:
        h = x
        for w in weights:
            h = torch.relu(h @ w)
        h.sum().backward()

    return run


def _worker(core: int, chunk_s: float, seconds: float, ready: Any, out: Any) -> None:
    """Pin to `core`, size a piece to `chunk_s`, wait for every other core's process (`ready`), then time pieces
    for `seconds`."""
    try:
        import torch

        torch.set_num_threads(1)
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {core})
        run = _piece()
        for _ in range(10):
            run()
        began = time.perf_counter()
        for _ in range(10):
            run()
        repeats = max(1, round(chunk_s / ((time.perf_counter() - began) / 10)))
        ready.wait(_GRACE_S)
        timed, end = [], time.time() + seconds
        while time.time() < end:
            wall, began = time.time(), time.perf_counter()
            for _ in range(repeats):
                run()
            timed.append((wall, time.perf_counter() - began))
        out.put((core, timed))
    except Exception as exc:  # reported, not raised: the parent must not wait for a queue item that never comes
        ready.abort()  # the other cores' processes stop waiting for this one
        out.put((core, f"{type(exc).__name__}: {exc}"))


def spread(values: list[float]) -> float:
    """The interquartile range of `values` over their median (0 with fewer than 2): how much the same thing's times
    vary from one to the next, robust to a few stalls."""
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / q[1]


def _autocorrelation(values: list[float]) -> float:
    if len(values) < 3:
        return 0.0
    mean = statistics.fmean(values)
    den = sum((v - mean) ** 2 for v in values)
    num = sum((values[i] - mean) * (values[i + 1] - mean) for i in range(len(values) - 1))
    return num / den if den > 0 else 0.0


def _binned(timed: list[tuple[float, float]], origin: float, width: float) -> dict[int, float]:
    bins: dict[int, list[float]] = {}
    for wall, seconds in timed:
        bins.setdefault(int((wall - origin) / width), []).append(seconds)
    return {k: statistics.fmean(v) for k, v in bins.items()}


def noise_of(timed: dict[int, list[tuple[float, float]]]) -> HostNoise:
    """The figures of `HostNoise` from each core's (wall start, seconds) pieces."""
    cores = sorted(timed)
    times = {c: [s for _, s in timed[c]] for c in cores}
    chunk = statistics.median([s for c in cores for s in times[c]])
    origin = min(timed[c][0][0] for c in cores if timed[c])
    bins = {c: _binned(timed[c], origin, chunk) for c in cores}
    pairs = []
    for i, a in enumerate(cores):
        for b in cores[i + 1 :]:
            shared = sorted(set(bins[a]) & set(bins[b]))
            if len(shared) >= 3:
                xs, ys = [bins[a][k] for k in shared], [bins[b][k] for k in shared]
                # A core that never varied correlates with nothing (statistics.correlation refuses it).
                steady = len(set(xs)) < 2 or len(set(ys)) < 2
                pairs.append(0.0 if steady else statistics.correlation(xs, ys))
    return HostNoise(
        chunk,
        [spread(times[c]) for c in cores],
        [_autocorrelation(times[c]) for c in cores],
        statistics.fmean(pairs) if pairs else float("nan"),
        [len(times[c]) for c in cores],
    )


def measure_host_noise(seconds: float = 4.0, chunk_s: float = 0.05) -> HostNoise:
    """Time the same work on every core this process may use (at most `MAX_CORES`), all at once; see the module."""
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = usable[:MAX_CORES]
    ctx = mp.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Barrier(len(cores))
    procs = [ctx.Process(target=_worker, args=(c, chunk_s, seconds, ready, out), daemon=True) for c in cores]
    for proc in procs:
        proc.start()
    found: dict[int, list[tuple[float, float]]] = {}
    deadline = time.time() + seconds + 2 * _GRACE_S
    try:
        for _ in cores:
            core, timed = out.get(timeout=max(1.0, deadline - time.time()))
            if isinstance(timed, str):
                raise RuntimeError(f"host noise: the process on core {core} failed: {timed}")
            found[core] = timed
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    return noise_of(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=4.0, help="how long every core times pieces")
    parser.add_argument("--chunk-ms", type=float, default=50.0, help="the length of one piece of work")
    args = parser.parse_args()
    noise = measure_host_noise(args.seconds, args.chunk_ms / 1e3)
    print(noise.summary())
    for core, (spread, auto, n) in enumerate(zip(noise.spread, noise.autocorrelation, noise.pieces, strict=True)):
        print(f"  core {core}: {n} pieces, spread {100 * spread:.1f} %, lag-1 autocorrelation {auto:.2f}")


if __name__ == "__main__":
    main()
