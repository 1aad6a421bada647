"""Timelines of a training iteration: one schema for predicted (simulator) and measured (runtime) runs.

A `Timeline` holds spans (an instruction on a rank's compute or comm track) and memory samples.
`write_trace` stores it as a Chrome trace (JSON object format, opens in Perfetto and
chrome://tracing) and `read_trace` loads it back, so a measured and a predicted timeline of the same
plan can be compared or overlaid. The trace layout:

- one process (`pid`) per rank, named by `rank_labels`;
- thread (`tid`) 0 is the compute track; transfers and allreduces go on comm threads 1, 2, ...
  (overlapping transfers are packed into as many comm threads as they need);
- every span is a complete event (`ph: "X"`, `ts`/`dur` in microseconds) whose `args` carry the
  instruction: `kind`, `stage`, `mb`, `peer`, `index` (position in the rank program), on the
  simulated critical path `critical: true`, and in a measured run on Linux `queued_s` (seconds the
  rank waited for a CPU within the span); instructions that take no time are left out;
- memory is a counter event (`ph: "C"`, name `memory`, `args: {"bytes": ...}`) per change;
- `otherData` holds `dapple_trace` (the schema version), `source` (`simulated` or `measured`),
  `iteration_s` and free-form metadata.

`dapple_ir.sim.drawing.draw_timeline` renders a timeline as a PNG Gantt chart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dapple_ir.errors import DappleError
from dapple_ir.ir import COMPUTE_KINDS, InstrKind
from dapple_ir.plan_dir import replace_file
from dapple_ir.sim.simulator import COMM_KINDS, COMPUTE_STREAM_KINDS, SimulationResult

TRACE_VERSION = 1
COMPUTE_TRACK = "compute"
COMM_TRACK = "comm"

#: Short labels of compute kinds, followed by the microbatch number (`F3`, `B3`, `W3`).
_PREFIX = {
    InstrKind.FORWARD.value: "F",
    InstrKind.BACKWARD.value: "B",
    InstrKind.BACKWARD_INPUT.value: "B",
    InstrKind.BACKWARD_WEIGHT.value: "W",
}
assert set(_PREFIX) == {k.value for k in COMPUTE_KINDS}


@dataclass(frozen=True, slots=True)
class Span:
    """One instruction's time on one track of one rank (the runtime builds these positionally: add
    new fields at the end, with a default)."""

    rank: int
    track: str
    """`compute` or `comm`."""
    kind: str
    """Instruction kind (`forward`, `send`, ...; an `InstrKind` value)."""
    start_s: float
    end_s: float
    stage: str | None = None
    mb: int | None = None
    peer: int | None = None
    """Other end of a transfer."""
    index: int | None = None
    """Position of the instruction in the rank's program."""
    critical: bool = False
    """On the simulated critical path (the chain of work and waits that sets the iteration time)."""
    queued_s: float | None = None
    """Measured runs on Linux: seconds of the span the rank's thread spent runnable but waiting for a CPU (the run
    queue, `backends/torch/run_queue.py`): time lost to cores shared with other work, not to the plan."""

    @property
    def computes(self) -> bool:
        """Whether the span runs a stage's computation (forward or a backward kind)."""
        return self.kind in _PREFIX

    @property
    def name(self) -> str:
        if self.kind in _PREFIX and self.mb is not None:
            return f"{_PREFIX[self.kind]}{self.mb}"
        if self.kind == "send" and self.peer is not None:
            return f"send mb {self.mb} → rank {self.peer}"
        if self.kind == "allreduce":
            return f"allreduce {self.stage or ''}".strip()
        return self.kind


@dataclass(frozen=True, slots=True)
class MemorySample:
    """Bytes a rank holds from `time_s` on."""

    rank: int
    time_s: float
    bytes: float


@dataclass(slots=True)
class Timeline:
    """Spans and memory of one or more iterations on every rank."""

    ranks: int
    spans: list[Span] = field(default_factory=list)
    memory: list[MemorySample] = field(default_factory=list)
    source: str = "simulated"
    """`simulated` or `measured`."""
    iteration_s: float = 0.0
    rank_labels: list[str] = field(default_factory=list)
    """Display name of each rank (`rank 0 · device 0 · s0`)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form: module, cluster, schedule, microbatches, ..."""

    def label(self, rank: int) -> str:
        return self.rank_labels[rank] if rank < len(self.rank_labels) else f"rank {rank}"


# ------------------------------------------------------------------------------- from simulation


def from_simulation(result: SimulationResult) -> Timeline:
    """The timeline of a simulated iteration: compute and comm spans, memory after each change."""

    module = result.module
    critical = set(result.critical_path)
    spans: list[Span] = []
    for event in result.events():
        instr = event.instr
        if instr.kind in COMPUTE_STREAM_KINDS:
            track = COMPUTE_TRACK
        elif instr.kind in COMM_KINDS:
            track = COMM_TRACK
        else:
            continue
        if event.end_s <= event.start_s:
            continue
        stage = instr.stage.name if instr.stage is not None else instr.param
        spans.append(
            Span(
                event.rank,
                track,
                instr.kind.value,
                event.start_s,
                event.end_s,
                stage,
                instr.mb,
                instr.peer,
                event.index,
                (event.rank, event.index) in critical,
            )
        )
    samples = [MemorySample(r, t, b) for r, curve in enumerate(result.memory) for t, b in curve]
    labels = []
    for r, program in enumerate(module.programs):
        hosted = ",".join(program.attrs.stages or ())
        device = program.attrs.device
        labels.append(
            f"rank {r}" + (f" · dev {device}" if device is not None else "") + (f" · {hosted}" if hosted else "")
        )
    metadata: dict[str, Any] = {"module": module.name, "cluster": result.cluster_name}
    for key in ("schedule", "microbatches", "microbatch_size"):
        value = getattr(module.attrs, key)
        if value is not None:
            metadata[key] = value
    return Timeline(result.ranks, spans, samples, "simulated", result.iteration_s, labels, metadata)


def overlay(predicted: Timeline, measured: Timeline) -> Timeline:
    """One timeline with each rank's predicted row followed by its measured row (both start at time 0).

    Draw it with `draw_timeline` or write it with `write_trace` to compare a plan's simulation with a run.
    """
    ranks = max(predicted.ranks, measured.ranks)
    spans: list[Span] = []
    samples: list[MemorySample] = []
    labels: list[str] = []
    for row, timeline in enumerate((predicted, measured)):
        origin = min((s.start_s for s in timeline.spans), default=0.0)
        spans += [
            replace(s, rank=2 * s.rank + row, start_s=s.start_s - origin, end_s=s.end_s - origin)
            for s in timeline.spans
        ]
        samples += [MemorySample(2 * m.rank + row, max(0.0, m.time_s - origin), m.bytes) for m in timeline.memory]
    for r in range(ranks):
        labels += [f"rank {r} {predicted.source}", f"rank {r} {measured.source}"]
    metadata = dict(predicted.metadata)
    metadata["compared_with"] = measured.source
    iteration = max(predicted.iteration_s, measured.iteration_s)
    return Timeline(2 * ranks, spans, samples, f"{predicted.source} vs {measured.source}", iteration, labels, metadata)


# --------------------------------------------------------------------------------- trace writer


def write_trace(timeline: Timeline, path: str | Path) -> None:
    """Write `timeline` as Chrome trace JSON (see the module docstring for the layout)."""
    events: list[dict[str, Any]] = []
    lanes = _pack_comm_lanes(timeline.spans)
    for r in range(timeline.ranks):
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": timeline.label(r)}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": COMPUTE_TRACK}})
    for rank, lane in sorted({(span.rank, lane) for span, lane in zip(timeline.spans, lanes, strict=True) if lane}):
        name = COMM_TRACK if lane == 1 else f"{COMM_TRACK} {lane}"
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": lane, "args": {"name": name}})
    for span, lane in zip(timeline.spans, lanes, strict=True):
        args: dict[str, Any] = {"kind": span.kind}
        for key in ("stage", "mb", "peer", "index"):
            value = getattr(span, key)
            if value is not None:
                args[key] = value
        if span.critical:
            args["critical"] = True
        if span.queued_s is not None:
            args["queued_s"] = span.queued_s
        events.append(
            {
                "name": span.name,
                "cat": span.kind,
                "ph": "X",
                "pid": span.rank,
                "tid": lane,
                "ts": span.start_s * 1e6,
                "dur": (span.end_s - span.start_s) * 1e6,
                "args": args,
            }
        )
    for sample in timeline.memory:
        events.append(
            {
                "name": "memory",
                "ph": "C",
                "pid": sample.rank,
                "ts": sample.time_s * 1e6,
                "args": {"bytes": sample.bytes},
            }
        )
    other = {"dapple_trace": TRACE_VERSION, "source": timeline.source, "iteration_s": timeline.iteration_s}
    other.update(timeline.metadata)
    document = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
    text = json.dumps(document, separators=(",", ":")) + "\n"
    replace_file(Path(path), lambda tmp: tmp.write_text(text))


def _pack_comm_lanes(spans: list[Span]) -> list[int]:
    """The tid of each span: 0 for compute; comm spans packed greedily into non-overlapping lanes 1, 2, ..."""
    lanes = [0] * len(spans)
    lane_free: dict[int, list[float]] = {}
    order = sorted((s.start_s, i) for i, s in enumerate(spans) if s.track != COMPUTE_TRACK)
    for _start, i in order:
        span = spans[i]
        free = lane_free.setdefault(span.rank, [])
        for lane, until in enumerate(free):
            if until <= span.start_s:
                free[lane] = span.end_s
                lanes[i] = lane + 1
                break
        else:
            free.append(span.end_s)
            lanes[i] = len(free)
    return lanes


# --------------------------------------------------------------------------------- trace reader


def read_trace(path: str | Path) -> Timeline:
    """Load a Chrome trace written by `write_trace` (the simulator or the runtime)."""
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DappleError(f"cannot read trace {path}: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        raise DappleError(f"{path} is not a Chrome trace in JSON object format (no traceEvents list)")
    other = document.get("otherData") or {}
    labels: dict[int, str] = {}
    spans: list[Span] = []
    samples: list[MemorySample] = []
    ranks = 0
    for event in document["traceEvents"]:
        phase, pid = event.get("ph"), int(event.get("pid", 0))
        ranks = max(ranks, pid + 1)
        args = event.get("args") or {}
        if phase == "M" and event.get("name") == "process_name":
            labels[pid] = str(args.get("name", f"rank {pid}"))
        elif phase == "X":
            start = float(event["ts"]) / 1e6
            spans.append(
                Span(
                    pid,
                    COMPUTE_TRACK if int(event.get("tid", 0)) == 0 else COMM_TRACK,
                    str(args.get("kind", event.get("cat", event.get("name", "")))),
                    start,
                    start + float(event.get("dur", 0.0)) / 1e6,
                    args.get("stage"),
                    args.get("mb"),
                    args.get("peer"),
                    args.get("index"),
                    bool(args.get("critical", False)),
                    args.get("queued_s"),
                )
            )
        elif phase == "C" and event.get("name") == "memory":
            samples.append(MemorySample(pid, float(event["ts"]) / 1e6, float(args.get("bytes", 0.0))))
    reserved = {"dapple_trace", "source", "iteration_s"}
    metadata = {k: v for k, v in other.items() if k not in reserved}
    iteration = float(other.get("iteration_s") or max((s.end_s for s in spans), default=0.0))
    return Timeline(
        ranks,
        spans,
        samples,
        str(other.get("source", "measured")),
        iteration,
        [labels.get(r, f"rank {r}") for r in range(ranks)],
        metadata,
    )
