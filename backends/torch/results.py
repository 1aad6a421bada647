"""What a run measured: the ranks' reports read back and aggregated into one `RunResult`.

Each rank reports into the run directory (its losses, step times, spans, memory samples) and hands
back its final parameters, buffers and recorded gradients; `aggregate` turns them into the loss of
every step, samples/s, peak memory per rank, the share of time spent waiting for a CPU, and the
measured timeline of the last step (`timeline_measured.json`, the simulator's trace format).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from dapple_ir import plan_dir
from dapple_ir.backends.torch.random_draws import Site
from dapple_ir.backends.torch.tensor_parallel import gather_shards, tensor_groups
from dapple_ir.backends.torch.worker import hosted_stages
from dapple_ir.errors import RuntimeFailure
from dapple_ir.plan_dir import Plan
from dapple_ir.sim.trace import MemorySample, Span, Timeline, write_trace


@dataclass
class CheckResult:
    """Pipelined vs single-device training after the same steps (see `check.compare_with_reference` for the rule)."""

    max_loss_diff: float
    max_param_diff: float
    worst_param: str
    ok: bool
    max_grad_diff: float = 0.0
    """Largest difference of a gradient of step 0, relative to the largest reference gradient."""
    worst_grad: str = ""
    max_buffer_diff: float = 0.0
    worst_buffer: str = ""
    noise_elements: int = 0
    """Parameter elements whose reference gradient was at noise level in some step under Adam or AdamW (its sign not
    determined): compared within the farthest two runs of Adam can step them apart (`tolerances.adam_reach`)."""
    averaged_buffers: int = 0
    """Buffers of replicated stages: averaged over replicas (checked equal there), not compared to the reference."""
    failures: list[str] = field(default_factory=list)
    """What differs beyond tolerance, one line each (the first few)."""
    notes: list[str] = field(default_factory=list)
    """What may explain the failures (where the runs part, a model that amplifies rounding)."""


@dataclass
class RunResult:
    """What a run measured."""

    losses: list[float]
    """Mean microbatch loss of each step run, in order."""
    first_step: int
    """Index of the first step run (non-zero after a resume)."""
    samples_per_s: float
    """Global-batch samples per second over the steps after the first (all steps when only one ran)."""
    peak_bytes: list[int]
    """Measured peak memory of each rank."""
    devices: list[str]
    timeline: Path | None
    params: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)
    """Final parameters per rank, `stage/name` keys."""
    buffers: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)
    """Final buffers per rank, `stage/name` keys."""
    grads: dict[int, dict[int, dict[str, torch.Tensor]]] = field(default_factory=dict, repr=False)
    """With `check`: per rank, by step (step 0 only), the gradients the optimizer saw (`stage/name` keys)."""
    sites: list[Site] = field(default_factory=list, repr=False)
    """The random draws of one microbatch's forward, every stage's, in graph order."""
    check: CheckResult | None = None
    cpu_waits: list[float | None] = field(default_factory=list)
    """Per rank, the share of the timed steps it spent runnable but waiting for a CPU (`Span.queued_s`); None
    where the system does not say. Large where ranks outnumber the cores they share."""
    step_s: list[float] = field(default_factory=list)
    """Each step run, in order: seconds from the end of the one before (every rank done) to its own end; the first
    from its start. The steady step is the median past the first few (they warm caches and allocators up)."""
    cores: list[list[int] | None] = field(default_factory=list)
    """Per rank, the CPU cores it was pinned to (`cores.pin_rank`); None where it was not (CUDA, threads, `pin`
    off, fewer cores than ranks on its node)."""


def read_reports(run_dir: Path, pattern: str, ranks: list[int]) -> dict[int, dict[str, Any]]:
    """The JSON reports (`pattern` with the rank) that `ranks` wrote into the run directory, by rank."""
    found = {}
    for rank in ranks:
        path = run_dir / pattern.format(rank)
        if path.is_file():
            found[rank] = json.loads(path.read_text())
    return found


def aggregate(plan: Plan, reports: dict[int, dict[str, Any]], states: dict[int, dict[str, Any]]) -> RunResult:
    """One `RunResult` from the ranks' reports (losses, times, memory, spans) and final states."""
    per_step: dict[int, dict[int, float]] = {}
    for report in reports.values():
        for step, mbs in report["losses"].items():
            # Each replica of a split loss stage reports its share of a microbatch's loss: they add up.
            found = per_step.setdefault(int(step), {})
            for m, v in mbs.items():
                found[int(m)] = found.get(int(m), 0.0) + v
    steps = sorted(per_step)
    losses = []
    for step in steps:
        mbs = per_step[step]
        if len(reports) < plan.ranks:
            continue  # multi-node: the node holding every loss stage replica prints the losses
        if len(mbs) != plan.microbatches:
            raise RuntimeFailure(f"step {step} computed the loss of {len(mbs)} microbatches, not {plan.microbatches}")
        losses.append(sum(mbs[m] for m in sorted(mbs)) / plan.microbatches)
    windows = _step_windows(reports)
    timed = [k for k in windows if k != min(windows)] or list(windows)
    seconds = sum(windows[k][1] - windows[k][0] for k in timed)
    rate = plan.global_batch * len(timed) / seconds if seconds > 0 else 0.0
    timeline = _write_timeline(plan, reports, windows) if windows else None
    states = whole_states(plan, states)
    return RunResult(
        losses=losses,
        first_step=steps[0] if steps else 0,
        samples_per_s=rate,
        peak_bytes=[int(reports[r]["peak_bytes"]) for r in sorted(reports)],
        devices=[str(reports[r]["device"]) for r in sorted(reports)],
        timeline=timeline,
        params={r: state["params"] for r, state in states.items()},
        buffers={r: state["buffers"] for r, state in states.items()},
        grads={r: state["grads"] for r, state in states.items()},
        sites=_sites_in_graph_order(plan, states),
        cpu_waits=[cpu_wait(reports[r], [windows[k] for k in timed]) for r in sorted(reports)],
        cores=[reports[r].get("cores") for r in sorted(reports)],
        step_s=_periods(windows),
    )


def whole_states(plan: Plan, states: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The ranks' final states with every tensor-parallel parameter (and recorded gradient) whole again: on its
    tensor group's member 0, put together from the members' slices (`tensor_parallel.gather_shards`)."""
    groups = tensor_groups(plan.module, lambda r: hosted_stages(plan.module, r))
    if not groups:
        return states
    params = gather_shards(plan.module, {r: s["params"] for r, s in states.items()}, groups)
    steps = sorted({step for s in states.values() for step in s["grads"]})
    grads = {
        step: gather_shards(plan.module, {r: s["grads"].get(step, {}) for r, s in states.items()}, groups)
        for step in steps
    }
    return {
        r: {**s, "params": params[r], "grads": {step: grads[step][r] for step in s["grads"]}} for r, s in states.items()
    }


def cpu_wait(report: dict[str, Any], windows: list[tuple[float, float]]) -> float | None:
    """The share of `windows` (the timed steps) the rank spent waiting for a CPU within its instructions."""
    inside = [s for s in report["spans"] if any(a <= s["start_s"] and s["end_s"] <= b for a, b in windows)]
    seconds = sum(b - a for a, b in windows)
    if not inside or seconds <= 0 or any(s.get("queued_s") is None for s in inside):
        return None
    return sum(s["queued_s"] for s in inside) / seconds


def _sites_in_graph_order(plan: Plan, states: dict[int, dict[str, Any]]) -> list[Site]:
    """Every stage's random draws (replicas report the same), ordered as the model's ops run."""
    order = {op.name: i for i, op in enumerate(plan.module.ops)}
    sites: set[Site] = set()
    for state in states.values():
        for stage, drawn in state["sites"].items():
            for op, index in drawn:
                if op not in order:
                    raise RuntimeFailure(f"stage @{stage} drew random numbers in %{op}, an op the plan does not have")
                sites.add((op, int(index)))
    return sorted(sites, key=lambda site: (order[site[0]], site[1]))


def _periods(windows: dict[int, tuple[float, float]]) -> list[float]:
    """`RunResult.step_s` from the steps' windows (earliest start, latest end over the ranks)."""
    steps = sorted(windows)
    return [windows[k][1] - (windows[steps[i - 1]][1] if i else windows[k][0]) for i, k in enumerate(steps)]


def _step_windows(reports: dict[int, dict[str, Any]]) -> dict[int, tuple[float, float]]:
    windows: dict[int, tuple[float, float]] = {}
    for report in reports.values():
        for step, (start, end) in report["step_times"].items():
            k = int(step)
            old = windows.get(k, (start, end))
            windows[k] = (min(old[0], start), max(old[1], end))
    return windows


def _write_timeline(plan: Plan, reports: dict[int, dict[str, Any]], windows: dict[int, tuple[float, float]]) -> Path:
    """The last step's spans and memory on every rank, in the simulator's trace format."""

    start, end = windows[max(windows)]
    spans, memory = [], []
    for rank, report in sorted(reports.items()):
        for s in report["spans"]:
            span = Span(**s)
            if start <= span.start_s <= end:
                spans.append(replace(span, start_s=span.start_s - start, end_s=span.end_s - start))
        memory += [MemorySample(rank, t - start, float(b)) for t, b in report["memory"] if start <= t <= end]
    labels = [f"rank {r} · {','.join(reports[r]['stages'])}" for r in sorted(reports)]
    metadata = {"module": plan.module.name, "microbatches": plan.microbatches, "microbatch_size": plan.microbatch_size}
    if plan.module.attrs.schedule:
        metadata["schedule"] = plan.module.attrs.schedule
    timeline = Timeline(plan.ranks, spans, memory, "measured", end - start, labels, metadata)
    path = plan.dir / plan_dir.TIMELINE_MEASURED
    write_trace(timeline, path)
    return path
