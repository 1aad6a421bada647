"""The picture of a timeline: a PNG Gantt chart per rank with the memory curve beneath.

matplotlib is imported when a picture is drawn (an Agg canvas on a bare Figure, no pyplot), so
reading and writing traces stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dapple_ir.plan_dir import replace_file
from dapple_ir.sim.trace import COMPUTE_TRACK, Timeline
from dapple_ir.units import bytes_unit, format_seconds, seconds_unit

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
    ranks_stages = {(s.rank, s.stage) for s in timeline.spans if s.computes}
    if len(ranks_stages) > len({rank for rank, _ in ranks_stages}):
        hatched = Patch(facecolor=colormaps["Blues"](0.7), edgecolor=_HATCH_EDGE, hatch="///", linewidth=0)
        hatched.set_label("later virtual stage")
        legend.append(hatched)
    if any(span.critical for span in timeline.spans):
        legend.append(Patch(facecolor="none", edgecolor="black", linewidth=1.2, label="critical path"))
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    replace_file(Path(path), lambda tmp: fig.savefig(tmp, dpi=_DPI))
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
            if span.computes:
                chunk = chunk_of.setdefault((y, span.stage), sum(1 for rank, _ in chunk_of if rank == y))
                if chunk:
                    later_chunk.append(boxes[-1])
            box_colors.append(palette.get((span.kind, (span.mb or 0) % len(_SHADES)), "#7f7f7f"))
            if span.mb is not None and span.computes and width * px_per_s >= 7 + 6 * len(str(span.mb)):
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
    unit, size = bytes_unit(peak)
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
