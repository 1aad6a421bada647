"""The host's own time per instruction and per message, measured on the runtime itself.

Besides the ops it runs, each compute instruction costs the rank some host time: issuing it, the frees
and loads around it, the runtime's bookkeeping; and every send and receive costs the ranks at its ends
time of their own (handing the send to the transport, finishing a receive whose data is there; on a CPU
the transport's socket thread shares the rank's core). `calibrate.measure_host_time` trains a small MLP with
`dapple run` on the ranks a device has, reads the instruction spans every rank recorded, and fits
`DeviceKind.instruction_overhead` and `message_overhead` (`frontend/calibration_fits.fit_host_time`): what
`dapple calibrate` writes and the simulator and the planner charge (`sim.simulator.host_s`,
`cost_model.host_s`). From the same run it fits `DeviceKind.wake_overhead`, what a rank that blocked on a peer
waits for a core once the peer's data is there (`wake_delays`, `calibration_fits.fit_wake`). Here: the model it
trains and how a rank's report is read.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

#: (width, depth, microbatch rows, microbatches) of the MLP `measure_host_time` trains: ops of about a millisecond
#: on one CPU core, so that the host's share is neither lost in them nor all there is.
TIMING_MLP = (256, 8, 32, 8)
#: Steps `measure_host_time` runs, and the first ones it leaves out (allocation, the meter's steps).
TIMING_STEPS, TIMING_WARMUP = 14, 3
#: The span kinds that compute (each is an instruction the host pays `instruction_overhead` for).
COMPUTE = frozenset({"forward", "backward", "backward_input", "backward_weight"})
#: Span kinds the host pays `message_overhead` for; a receive's span beyond its cost when the data is there is
#: waiting for the peer, not host work.
MESSAGES = frozenset({"send", "recv"})
#: Spans in which the rank may wait for another rank (a receive, an allreduce).
WAITS = frozenset({"recv", "allreduce", "reduce_scatter", "all_gather"})


def timing_model() -> tuple[Any, ...]:
    """The model spec `measure_host_time` compiles (`dapple_ir.backends.torch.host_time:timing_model`)."""
    width, depth, rows, microbatches = TIMING_MLP
    layers = [m for _ in range(depth) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    model = torch.nn.Sequential(*layers)
    batch = rows * microbatches
    return model, (torch.randn(batch, width),), F.mse_loss, (torch.randn(batch, width),)


def host_samples(report: dict[str, Any], warmup: int) -> list[tuple[int, float]]:
    """Per compute instruction of a rank's steps after `warmup` (a `rank_<r>.json` the worker wrote): (the sends
    and receives since the rank's previous compute instruction, the host seconds since its end). Host seconds are
    the gaps between spans and the spans of everything but compute, a receive's or allreduce's only up to what it
    costs when its data is there (the rank's 10th-percentile such span): beyond that the rank waited for a peer."""
    spans = report["spans"]
    floor = receive_floor(report)
    samples = []
    for step in sorted(int(k) for k in report["step_times"])[warmup:]:
        start, end = report["step_times"][str(step)]
        inside = sorted((sp for sp in spans if start <= sp["start_s"] and sp["end_s"] <= end), key=_start)
        clock, host, messages = start, 0.0, 0
        for sp in inside:
            length = sp["end_s"] - sp["start_s"]
            host += max(0.0, sp["start_s"] - clock)
            clock = sp["end_s"]
            if sp["kind"] in COMPUTE:
                samples.append((messages, host))
                host, messages = 0.0, 0
                continue
            if sp["kind"] == "optimizer_step":
                host, messages = 0.0, 0  # its own time, and no instruction of ours: it starts afresh
                continue
            host += min(length, floor) if sp["kind"] in WAITS else length
            messages += sp["kind"] in MESSAGES
    return samples


def wake_delays(report: dict[str, Any], warmup: int) -> list[float]:
    """Per receive or allreduce of a rank's steps after `warmup` that blocked (`blocked`): the time the rank was
    runnable but had no core in it (`Span.queued_s`, Linux's run-queue delay; absent where the runtime cannot read
    it, then 0). A rank that waited for a peer sleeps; once the data comes it is woken and, where the ranks outnumber
    the cores, waits in the run queue while the others compute: what `DeviceKind.wake_overhead` prices."""
    floor = receive_floor(report)
    delays = []
    for step in sorted(int(k) for k in report["step_times"])[warmup:]:
        start, end = report["step_times"][str(step)]
        for sp in report["spans"]:
            if sp["kind"] in WAITS and start <= sp["start_s"] and sp["end_s"] <= end and blocked(sp, floor):
                delays.append(float(sp.get("queued_s") or 0.0))
    return delays


def blocked(span: dict[str, Any], floor: float) -> bool:
    """Whether a receive (or allreduce) waited for its data: its span is over twice its rank's `receive_floor`."""
    return bool(span["end_s"] - span["start_s"] > 2 * floor)


def receive_floor(report: dict[str, Any]) -> float:
    """What a receive (or allreduce) costs a rank when its data is already there: the 10th percentile of its
    spans of those kinds in the report (`rank_<r>.json`); beyond it, the rank waited for a peer."""
    waits = sorted(sp["end_s"] - sp["start_s"] for sp in report["spans"] if sp["kind"] in WAITS)
    return waits[len(waits) // 10] if waits else 0.0


def _start(span: dict[str, Any]) -> float:
    return float(span["start_s"])
