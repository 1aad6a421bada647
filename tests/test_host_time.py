"""The host's own time per instruction and per message, read off the runtime's spans
(`backends/torch/host_time.py`) and fitted (`commands/calibrate.fit_host_time`); `dapple calibrate` writes it
(tests/test_costs_calibrate.py runs the real measurement)."""

from __future__ import annotations

from typing import Any

import pytest

from dapple_ir.backends.torch.host_time import host_samples, wake_delays
from dapple_ir.commands.calibrate import fit_host_time, fit_wake


def _span(kind: str, start: float, end: float, queued: float | None = None) -> dict[str, Any]:
    span: dict[str, Any] = {"kind": kind, "start_s": start, "end_s": end}
    if queued is not None:
        span["queued_s"] = queued
    return span


def test_host_samples_count_the_gaps_and_the_messages_before_each_computation() -> None:
    """By hand, one step (step 0 is warm-up and left out). Receive spans 0.1 (data there) and 5.0 (a wait): the
    10th percentile, 0.1, is what a receive costs the host, the rest of the 5.0 waiting. Rank's step 1 from 10.0:
    load 10.0-10.2, forward 10.3-11.3 (host: 0.2 load + 0.1 gap + 0 before = 0.3, 0 messages); send 11.3-11.4,
    recv 11.5-11.6, backward 11.7-13.7 (host 0.1 send + 0.1 gap + 0.1 recv + 0.1 gap = 0.4, 2 messages); recv
    13.8-18.8, forward 18.9-19.9 (host 0.1 gap + 0.1 of the receive + 0.1 gap = 0.3, 1 message); optimizer step
    19.9-20.0, then send 20.1-20.2 and backward 20.2-22.2 (the step's own time is not host work, the gap after it
    is: 0.1 + 0.1 = 0.2, 1 message)."""
    step1 = [
        _span("load_microbatch", 10.0, 10.2),
        _span("forward", 10.3, 11.3),
        _span("send", 11.3, 11.4),
        _span("recv", 11.5, 11.6),
        _span("backward", 11.7, 13.7),
        _span("recv", 13.8, 18.8),
        _span("forward", 18.9, 19.9),
        _span("optimizer_step", 19.9, 20.0),
        _span("send", 20.1, 20.2),
        _span("backward", 20.2, 22.2),
    ]
    step0 = [_span("recv", 0.5, 0.6), _span("forward", 0.6, 5.0)]
    report = {"spans": step0 + step1, "step_times": {"0": [0.0, 5.0], "1": [10.0, 22.5]}}
    assert [k for k, _ in host_samples(report, warmup=1)] == [0, 2, 1, 1]
    assert [h for _, h in host_samples(report, warmup=1)] == pytest.approx([0.3, 0.4, 0.3, 0.2])
    assert len(host_samples(report, warmup=0)) == 5  # step 0's forward too


def test_the_fit_is_the_least_squares_line_through_the_means() -> None:
    """Planted: h = 150 us + 200 us per message, each count's samples spread evenly around it: the line comes back.
    A tail counts in full (the host's time adds up over a step, where a median would drop it)."""
    a, b = 150e-6, 200e-6
    spread = (-50e-6, 0.0, 50e-6)
    samples = [(k, a + b * k + d) for k in (0, 1, 2) for d in spread for _ in range(10)]
    assert fit_host_time(samples) == pytest.approx((a, b))
    # At counts 1 and 2 one sample in ten 5 ms longer: their means rise by 0.5 ms, the line through the three means
    # (weighted alike: the same number of samples at each) by 0.25 ms per message, and its intercept by 1/12 ms.
    tailed = [(k, h + (5e-3 if k > 0 and i % 10 == 0 else 0.0)) for i, (k, h) in enumerate(samples)]
    assert fit_host_time(tailed) == pytest.approx((a + 0.5e-3 / 6, b + 0.25e-3))
    # One message count (a single rank: no messages): all of it is the instruction's, the mean.
    assert fit_host_time([(0, a), (0, a), (0, 4 * a)]) == pytest.approx((2 * a, 0.0))
    # A line falling with the messages: a constant per instruction, the mean.
    assert fit_host_time([(0, 3 * a), (1, 2 * a), (2, a)]) == pytest.approx((2 * a, 0.0))
    # A negative intercept: a price per message only, their seconds over their messages.
    assert fit_host_time([(0, 0.0), (1, b), (2, 3 * b), (2, 3 * b)]) == pytest.approx((0.0, 7 * b / 5))
    assert fit_host_time([]) == (0.0, 0.0)


def test_the_wake_is_the_run_queue_delay_of_the_waits_that_blocked() -> None:
    """By hand. Receive and allreduce spans of 0.1 (data there: the 10th percentile, so the floor) and longer; a wait
    blocked where its span is over twice the floor, 0.2. Step 1 (step 0 is warm-up): recv 0.1 queued 0.05 (did not
    block: its queueing is the host's, not a wake), recv 1.0 queued 0.3, allreduce 0.5 queued 0.1, recv 0.25 with no
    `queued_s` (a runtime that could not read it: 0), a forward queued 0.4 (not a wait). Delays 0.3, 0.1, 0: the
    wake is their mean, 4/30; the median (0.1) would drop the slice that the slow wake waited."""
    step0 = [_span("recv", 0.0, 9.0, queued=5.0)] + [_span("recv", 0.0, 0.1, queued=0.0) for _ in range(9)]
    step1 = [
        _span("recv", 10.0, 10.1, queued=0.05),
        _span("recv", 10.1, 11.1, queued=0.3),
        _span("forward", 11.1, 12.1, queued=0.4),
        _span("allreduce", 12.1, 12.6, queued=0.1),
        _span("recv", 12.6, 12.85),
    ]
    report = {"spans": step0 + step1, "step_times": {"0": [0.0, 9.5], "1": [10.0, 13.0]}}
    assert wake_delays(report, warmup=1) == pytest.approx([0.3, 0.1, 0.0])
    assert fit_wake(wake_delays(report, warmup=1)) == pytest.approx(0.4 / 3)
    assert wake_delays(report, warmup=0)[0] == pytest.approx(5.0)  # step 0's long wait too
    assert fit_wake([]) == 0.0
