"""The cost model's figures fitted to what was measured: `dapple calibrate` and the runtime benchmark both fit here.

Torch-free: the measuring (`measure.py`, `backends/torch/host_time.py`, the benchmark's runs) hands in
plain numbers or `dapple profile` JSONs, and these functions turn them into `DeviceKind` and `Link`
figures. A fitted line never prices anything below 0: one that falls is read as a constant, the
points' mean (`_rising_line`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from statistics import mean
from typing import Any

from dapple_ir.cluster.roofline import line_fit, roofline_times
from dapple_ir.cluster.spec import DeviceKind, Link
from dapple_ir.errors import DappleError

#: Efficiencies are clamped to this range: a class measured far below its roofline (tiny CPU ops
#: dominated by Python overhead) still gets a usable figure.
_EFFICIENCY_RANGE = (0.01, 1.0)


def _rising_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through `points` (`roofline.line_fit`) where it rises; where
    they all have one x, or the line is flat or falls, (the mean of their y, 0): a constant."""
    if len({x for x, _ in points}) < 2:
        return sum(y for _, y in points) / len(points), 0.0
    intercept, slope = line_fit(points)
    if slope <= 0:
        return sum(y for _, y in points) / len(points), 0.0
    return intercept, slope


def fit_host_time(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(seconds per compute instruction, seconds per message) from (messages before an instruction, its host
    seconds) samples: the least-squares line through them all (`roofline.line_fit`), so through the mean at each
    message count. The mean, not the median: the host's time adds up over a step, tail included (the transport's
    thread taking the core for a while now and then is what a step pays too); the median left out a quarter to
    two fifths of the total on the dev VM. Neither part is below 0: a line falling with the messages is read as a
    constant per instruction, the mean; one with a negative intercept as a price per message only."""
    if not samples:
        return 0.0, 0.0
    fixed, per_message = _rising_line([(float(k), h) for k, h in samples])
    if per_message == 0:
        return max(0.0, mean(h for _, h in samples)), 0.0
    if fixed < 0:
        with_messages = [(k, h) for k, h in samples if k > 0]
        return 0.0, sum(h for _, h in with_messages) / sum(k for k, _ in with_messages)
    return fixed, per_message


def fit_wake(delays: list[float]) -> float:
    """`wake_overhead` from the run-queue delays of the waits that blocked (`host_time.wake_delays`): their mean. Not
    the median: the delays add up over a step, and while most woken ranks find a core at once, a few wait a whole
    scheduler slice (on the dev VM, 4 ranks on 2 cores: a median of 0.02 ms against a mean of 0.45 ms). 0 with none
    (a single rank, or ranks that never waited)."""
    return max(0.0, sum(delays) / len(delays)) if delays else 0.0


def fit_split_price(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(`split_backward_overhead`, `split_backward_per_byte`): the least-squares line (`roofline.line_fit`) through
    the (parameter bytes, extra seconds) per layer that `measure_split_overhead` timed at each width. Neither part
    is below 0: a line that falls with size is read as a constant, the points' mean."""
    if len({x for x, _ in points}) < 2:
        line_fit(points)  # raises: a price per byte needs two widths or more
    fixed, per_byte = _rising_line(points)
    return max(0.0, fixed), per_byte


def fit_link(samples: list[tuple[float, float]]) -> Link:
    """latency + bytes / bandwidth, least squares over (bytes, seconds) samples; with one message size, their mean
    as latency.

    Least squares fits the mean cost at each size, and so does the one-size case: waiting adds up over the
    transfers a rank waits for, so a transfer's expected cost is the mean. On a 2-core host the times have a long
    tail (a socket thread or the woken rank waiting for a core): the mean is 2-4x the median there."""
    if not samples:
        return Link(math.inf, 0.0)
    latency, per_byte = _rising_line(samples)
    if per_byte == 0:
        return Link(math.inf, latency)
    return Link(1.0 / per_byte, max(0.0, latency))


def fit_efficiency(path: str, kind: DeviceKind) -> dict[str, float]:
    """Per op class: roofline seconds at full peak over measured seconds, summed over the class's ops.

    The device's per-call overhead is taken off the measured times first: efficiency describes the
    work an op does, the overhead its call. A profile that also timed the whole step (`step_s`) has
    its op times scaled to it first: an op timed alone carries call and synchronisation costs that
    the ops of a running step share, so the fitted model adds up to the step, not to the sum of parts.
    """
    compute_only = dataclasses.replace(kind, op_overhead=0.0)
    _batch, profile = read_profile(path)
    ops: dict[str, dict[str, Any]] = profile["ops"]
    scale = _step_scale(profile)
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


def fit_fixed_s(paths: list[str]) -> float:
    """Fixed seconds per op call, from profiles of one model at two or more microbatch sizes.

    An op call's time is affine in its microbatch b (`dapple_ir.cluster.roofline`): t = f + k b.
    Summed over the N calls (forward and backward of every op that takes time) that every profile
    timed, T(b) = N f + K b; the least-squares line through the profiles' (b, T(b)) has intercept
    N f. A negative intercept (noise on a machine with no fixed cost to speak of) gives 0. A profile
    that timed its whole step (`step_s`) has its op times scaled to it first (`_step_scale`), as
    `fit_efficiency` scales them: the fixed part and the efficiency then describe the same step (timed
    alone, an op carries call costs that the ops of a running step share; fitted from the unscaled sums
    while the efficiency came from the scaled ones, the bench MLP's cluster priced its steps at 32
    samples 6-15 % slow).
    """
    profiles = [read_profile(path) for path in paths]
    batches = {batch for batch, _profile in profiles}
    if len(batches) < 2:
        raise DappleError(
            f"calibrate: the fixed cost per op call is fitted from profiles at two or more microbatch sizes, "
            f"but {', '.join(paths)} all measured microbatch {batches.pop()}; profile again with another "
            "--microbatch"
        )
    shared = set.intersection(*(set(p["ops"]) for _batch, p in profiles))
    calls = {
        (name, key)
        for name in shared
        for key in ("fwd_s", "bwd_s")
        if all(float(p["ops"][name].get(key, 0.0)) > 0 for _batch, p in profiles)
    }
    if not calls:
        raise DappleError(f"calibrate: {', '.join(paths)} share no op that takes time; profile one model at each size")
    points = [
        (float(batch), _step_scale(p) * sum(float(p["ops"][name][key]) for name, key in calls)) for batch, p in profiles
    ]
    intercept, _slope = line_fit(points)
    return max(0.0, intercept / len(calls))


def _step_scale(profile: dict[str, Any]) -> float:
    """The profile's whole step (`step_s`) over the sum of its ops' times; 1 where it did not time the step."""
    summed = sum(float(e.get("fwd_s", 0.0)) + float(e.get("bwd_s", 0.0)) for e in profile["ops"].values())
    return float(profile["step_s"]) / summed if profile.get("step_s") and summed > 0 else 1.0


def has_flop_counts(path: str) -> bool:
    """Whether the profile at `path` has ops that `fit_efficiency` can fit (FLOP and byte counts)."""
    return any("op_class" in entry and "mem_bytes" in entry for entry in read_profile(path)[1]["ops"].values())


def read_profile(path: str) -> tuple[int, dict[str, Any]]:
    """(microbatch, the profile) of a JSON `dapple profile` wrote."""
    try:
        profile: dict[str, Any] = json.loads(Path(path).read_text())
        if not isinstance(profile["ops"], dict):
            raise TypeError("'ops' is not a table")
        return int(profile["microbatch"]), profile
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DappleError(f"calibrate: {path} is not a profile written by `dapple profile` ({exc})") from None
