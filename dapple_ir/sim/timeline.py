"""Timelines of a training iteration: one schema for predicted (simulator) and measured (runtime) runs.

A `Timeline` holds spans (an instruction on a rank's compute or comm track) and memory samples.
`write_trace` stores it as a Chrome trace (JSON object format, opens in Perfetto and
chrome://tracing) and `read_trace` loads it back, so a measured and a predicted timeline of the same
plan can be compared or overlaid. The trace layout:

- one process (`pid`) per rank, named by `rank_labels`;
- thread (`tid`) 0 is the compute track; transfers and allreduces go on comm threads 1, 2, ...
  (overlapping transfers are packed into as many comm threads as they need);
- every span is a complete event (`ph: "X"`, `ts`/`dur` in microseconds) whose `args` carry the
  instruction: `kind`, `stage`, `mb`, `peer`, `index` (position in the rank program) and, on the
  simulated critical path, `critical: true`; instructions that take no time are left out;
- memory is a counter event (`ph: "C"`, name `memory`, `args: {"bytes": ...}`) per change;
- `otherData` holds `dapple_trace` (the schema version), `source` (`simulated` or `measured`),
  `iteration_s` and free-form metadata.

`draw_timeline` renders a timeline as a PNG Gantt chart (matplotlib, imported lazily; an Agg canvas,
no pyplot).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dapple_ir.errors import DappleError
from dapple_ir.units import format_seconds, seconds_unit

if TYPE_CHECKING:
    from dapple_ir.sim.simulator import SimulationResult

TRACE_VERSION = 1
COMPUTE_TRACK = "compute"
COMM_TRACK = "comm"

#: Short labels of compute kinds, followed by the microbatch number (`F3`, `B3`, `W3`).
_PREFIX = {"forward": "F", "backward": "B", "backward_input": "B", "backward_weight": "W"}


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
    from dapple_ir.sim.simulator import COMM_KINDS, COMPUTE_KINDS

    module = result.module
    critical = set(result.critical_path)
    spans: list[Span] = []
    for event in result.events():
        instr = event.instr
        if instr.kind in COMPUTE_KINDS:
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
    Path(path).write_text(json.dumps(document, separators=(",", ":")) + "\n")


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


# ------------------------------------------------------------------------------------ the picture

#: Colormap of each compute kind: forward one hue, backward another, weight gradient a third.
_CMAPS = {"forward": "Blues", "backward": "Oranges", "backward_input": "Oranges", "backward_weight": "Greens"}
_SHADES = (0.45, 0.6, 0.75, 0.9)
_HATCH_EDGE = (1.0, 1.0, 1.0, 0.55)
_DPI = 100
_WIDTH_IN = 16.0
# Fixed margins and memory panel in inches, so the chart reads the same at 2 or 64 ranks.
_TOP_IN, _MID_IN, _MEMORY_IN, _BOTTOM_IN = 0.55, 0.75, 1.55, 0.55


def figure_size(ranks: int) -> tuple[int, int]:
    """Pixel size (width, height) of the picture `draw_timeline` writes for `ranks` ranks."""
    height_in = _TOP_IN + _gantt_height(ranks) + _MID_IN + _MEMORY_IN + _BOTTOM_IN
    return round(_WIDTH_IN * _DPI), round(height_in * _DPI)


def _gantt_height(ranks: int) -> float:
    return min(16.0, max(2.0, 0.5 * ranks))


def draw_timeline(timeline: Timeline, path: str | Path, *, title: str | None = None) -> tuple[int, int]:
    """Write a Gantt chart of `timeline` as PNG; returns its pixel size (width, height).

    Rows are ranks; compute boxes are coloured by kind and shaded by microbatch, labelled with the
    microbatch number where wide enough; a thin lane under each row shows transfers and allreduces;
    idle compute time (bubbles) shows as the pale row background; memory per rank is drawn beneath.
    """
    # An Agg canvas on a bare Figure: no pyplot, so no global backend switch and no figure registry.
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    width_px, height_px = figure_size(timeline.ranks)
    fig = Figure(figsize=(width_px / _DPI, height_px / _DPI), dpi=_DPI)
    FigureCanvasAgg(fig)
    gantt_in = _gantt_height(timeline.ranks)
    total_in = height_px / _DPI
    left, right = 0.09, 0.88
    gantt_bottom = (_BOTTOM_IN + _MEMORY_IN + _MID_IN) / total_in
    ax = fig.add_axes((left, gantt_bottom, right - left, gantt_in / total_in))
    ax_mem = fig.add_axes((left, _BOTTOM_IN / total_in, right - left, _MEMORY_IN / total_in), sharex=ax)
    end = max(timeline.iteration_s, max((s.end_s for s in timeline.spans), default=0.0)) or 1.0
    _draw_gantt(ax, timeline, end, px_per_s=(right - left) * width_px / end)
    _draw_memory(ax_mem, timeline, end)
    ax.set_xlim(0, end * 1.005)
    heading = title or _default_title(timeline)
    fig.text(left, 1 - _TOP_IN / 2 / total_in, heading, fontsize=12, weight="bold", va="center")
    kinds = {span.kind for span in timeline.spans}
    entries = [
        ({"forward"}, {"color": colormaps["Blues"](0.7)}, "forward (F)"),
        ({"backward"}, {"color": colormaps["Oranges"](0.7)}, "backward (B)"),
        ({"backward_input"}, {"color": colormaps["Oranges"](0.7)}, "input grad (B)"),
        ({"backward_weight"}, {"color": colormaps["Greens"](0.7)}, "weight grad (W)"),
        ({"optimizer_step"}, {"color": "#7f7f7f"}, "optimizer step"),
        ({"send"}, {"color": "#555555"}, "send (comm lane)"),
        ({"allreduce"}, {"color": "#d62728"}, "allreduce (comm lane)"),
    ]
    legend = [Patch(label=label, **style) for needed, style, label in entries if needed & kinds]  # type: ignore[arg-type]
    legend.append(Patch(facecolor="#eeeeee", edgecolor="#bbbbbb", label="idle (bubble)"))
    ranks_stages = {(s.rank, s.stage) for s in timeline.spans if s.kind in _PREFIX}
    if len(ranks_stages) > len({rank for rank, _ in ranks_stages}):
        hatched = Patch(facecolor=colormaps["Blues"](0.7), edgecolor=_HATCH_EDGE, hatch="///", linewidth=0)
        hatched.set_label("later virtual stage")
        legend.append(hatched)
    if any(span.critical for span in timeline.spans):
        legend.append(Patch(facecolor="none", edgecolor="black", linewidth=1.2, label="critical path"))
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    fig.savefig(path, dpi=_DPI)
    return width_px, height_px


def _default_title(timeline: Timeline) -> str:
    meta = timeline.metadata
    parts = [str(meta.get("module", "plan"))]
    if "schedule" in meta:
        parts.append(str(meta["schedule"]))
    if "microbatches" in meta:
        parts.append(f"{meta['microbatches']} microbatches")
    compared = "compared_with" in meta  # an overlay: two rows per rank, two iteration times
    parts.append(f"{timeline.ranks // 2 if compared else timeline.ranks} ranks")
    busy = sum(s.end_s - s.start_s for s in timeline.spans if s.track == COMPUTE_TRACK)
    if timeline.iteration_s > 0 and timeline.ranks and not compared:
        bubble = 1 - busy / (timeline.iteration_s * timeline.ranks)
        parts.append(f"bubble {100 * bubble:.1f} %")
    parts.append(f"iteration {format_seconds(timeline.iteration_s)} ({timeline.source})")
    return " · ".join(parts)


def _draw_gantt(ax: Any, timeline: Timeline, end: float, px_per_s: float) -> None:
    from matplotlib import colormaps

    box_h, lane_h = 0.62, 0.16
    # Colour of each (compute kind, microbatch shade); looking colormaps up per box is slow.
    palette = {(kind, i): colormaps[cmap](shade) for kind, cmap in _CMAPS.items() for i, shade in enumerate(_SHADES)}
    boxes: list[tuple[float, float, float, float]] = []
    box_colors: list[Any] = []
    bars: list[tuple[float, float, float, float]] = []
    bar_colors: list[str] = []
    labels: list[tuple[float, float, str, bool]] = []
    critical: list[tuple[float, float, float, float]] = []
    # A rank hosting several stages (interleaved): boxes of its second and later stages are hatched.
    later_chunk: list[tuple[float, float, float, float]] = []
    chunk_of: dict[tuple[int, str | None], int] = {}
    for span in timeline.spans:
        y = span.rank
        width = span.end_s - span.start_s
        if span.track == COMPUTE_TRACK:
            boxes.append((span.start_s, span.end_s, y - box_h / 2, y + box_h / 2))
            if span.critical:
                critical.append(boxes[-1])
            if span.kind in _PREFIX:
                chunk = chunk_of.setdefault((y, span.stage), sum(1 for rank, _ in chunk_of if rank == y))
                if chunk:
                    later_chunk.append(boxes[-1])
            box_colors.append(palette.get((span.kind, (span.mb or 0) % len(_SHADES)), "#7f7f7f"))
            if span.mb is not None and span.kind in _PREFIX and width * px_per_s >= 7 + 6 * len(str(span.mb)):
                dark = _SHADES[span.mb % len(_SHADES)] >= 0.75
                labels.append((span.start_s + width / 2, y, str(span.mb), dark))
        else:
            bars.append((span.start_s, span.end_s, y + box_h / 2 + 0.03, y + box_h / 2 + 0.03 + lane_h))
            bar_colors.append("#d62728" if span.kind == "allreduce" else "#555555")
    rows = [(0.0, end, r - box_h / 2, r + box_h / 2) for r in range(timeline.ranks)]
    # One collection per layer: thousands of boxes draw in a second (broken_barh per group took minutes).
    _add_rectangles(ax, rows, ["#eeeeee"] * len(rows), zorder=0)
    thin_edges = len(boxes) <= 4000
    _add_rectangles(ax, boxes, box_colors, zorder=1, edge="white" if thin_edges else None)
    _add_rectangles(ax, later_chunk, ["none"] * len(later_chunk), zorder=1.5, edge=_HATCH_EDGE, width=0.0, hatch="///")
    _add_rectangles(ax, bars, bar_colors, zorder=2)
    _add_rectangles(ax, critical, ["none"] * len(critical), zorder=2.5, edge="black", width=1.2)
    fontsize = 7 if timeline.ranks <= 16 else 5
    for x_mid, row, text, dark in labels:
        color = "white" if dark else "black"
        ax.text(x_mid, row, text, ha="center", va="center", fontsize=fontsize, color=color, zorder=3)
    ax.set_ylim(timeline.ranks - 0.35, -0.6)
    ax.set_yticks(range(timeline.ranks))
    ax.set_yticklabels([timeline.label(r) for r in range(timeline.ranks)], fontsize=8 if timeline.ranks <= 16 else 5)
    ax.tick_params(axis="x", labelbottom=False)
    ax.spines[["top", "right"]].set_visible(False)


def _add_rectangles(
    ax: Any,
    rects: list[tuple[float, float, float, float]],
    colors: list[Any],
    zorder: float,
    edge: Any = None,
    width: float = 0.4,
    hatch: str | None = None,
) -> None:
    """Add rectangles given as (x0, x1, y0, y1) as one PolyCollection."""
    from matplotlib.collections import PolyCollection

    if not rects:
        return
    import numpy as np

    x0, x1, y0, y1 = np.asarray(rects, dtype=float).T
    # Corners as one (N, 4, 2) array: matplotlib then builds the paths in bulk.
    verts: Any = np.stack([np.stack(corner, axis=1) for corner in ((x0, y0), (x0, y1), (x1, y1), (x1, y0))], axis=1)
    collection = PolyCollection(
        verts,
        facecolors=colors,
        edgecolors="none" if edge is None else edge,
        linewidths=width if edge is not None else 0.0,
        zorder=zorder,
        hatch=hatch,
    )
    ax.add_collection(collection, autolim=False)


def _draw_memory(ax: Any, timeline: Timeline, end: float) -> None:
    from matplotlib import colormaps
    from matplotlib.ticker import FuncFormatter

    by_rank: dict[int, list[tuple[float, float]]] = {}
    for sample in timeline.memory:
        by_rank.setdefault(sample.rank, []).append((sample.time_s, sample.bytes))
    peak = max((b for curve in by_rank.values() for _, b in curve), default=0.0)
    unit, size = _byte_unit(peak)
    cmap = colormaps["viridis"]
    for rank, curve in sorted(by_rank.items()):
        points = _collapse_instants(sorted(curve, key=lambda p: p[0]))
        xs = [t for t, _ in points] + [end]
        ys = [b / size for _, b in points] + [points[-1][1] / size]
        color = cmap(rank / max(1, timeline.ranks - 1))
        ax.step(xs, ys, where="post", linewidth=1.0, color=color, label=timeline.label(rank).split(" · ")[0])
    ax.set_ylabel(f"memory ({unit})", fontsize=8)
    time_unit, scale = seconds_unit(end, threshold=10.0)
    ax.set_xlabel(f"time ({time_unit})", fontsize=9)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x * scale:g}"))
    ax.tick_params(labelsize=8)
    ax.set_ylim(bottom=0)
    ax.grid(axis="y", alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)
    if by_rank and timeline.ranks <= 16:
        ncol = 2 if timeline.ranks > 8 else 1
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False, ncol=ncol)


def _collapse_instants(curve: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Several changes at one instant draw as a spike to their highest level, then the level after.

    A free followed by an allocation at the same time would otherwise draw a downward spike that no
    reader can see the reason for; an upward one is a real peak and stays.
    """
    points: list[tuple[float, float]] = []
    i = 0
    while i < len(curve):
        j = i
        while j + 1 < len(curve) and curve[j + 1][0] == curve[i][0]:
            j += 1
        top = max(b for _, b in curve[i : j + 1])
        if top > curve[j][1]:
            points.append((curve[i][0], top))
        points.append(curve[j])
        i = j + 1
    return points


def _byte_unit(nbytes: float) -> tuple[str, float]:
    units: tuple[tuple[str, float], ...] = (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10))
    for unit, size in units:
        if nbytes >= size:
            return unit, size
    return "B", 1.0
