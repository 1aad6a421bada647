"""Result tables every benchmark writes: printed as text, saved as JSON, rendered into BENCHMARKS.md.

A benchmark builds `Table`s, prints them, and (with `--json PATH`) saves a `Report` that
`run_all.py` turns into a section of BENCHMARKS.md. Cells are plain numbers or strings; a cell that
could not be measured is a string that says why ("not available: ..."), never a made-up number.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

Cell = float | int | str | None


@dataclass
class Table:
    """Rows of cells under named columns, with notes that say how the figures were measured."""

    name: str
    columns: list[str]
    rows: list[list[Cell]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: Cell) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"table {self.name}: row has {len(cells)} cells, columns are {self.columns}")
        self.rows.append(list(cells))

    def text(self) -> str:
        """Fixed-width text for the terminal."""
        cells = [self.columns] + [[fmt(c) for c in row] for row in self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.columns))]
        lines = [f"== {self.name}"]
        for k, row in enumerate(cells):
            lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
            if k == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def markdown(self) -> str:
        lines = [f"**{self.name}**", "", "| " + " | ".join(self.columns) + " |"]
        lines.append("|" + "|".join(" --- " for _ in self.columns) + "|")
        lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in self.rows]
        if self.notes:
            lines.append("")
            lines += [f"- {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass
class Report:
    """One benchmark's output: its tables, plots (paths relative to the repository) and headline lines."""

    benchmark: str
    title: str
    tables: list[Table] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    """Absolute paths of the plots written."""
    headlines: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    def finish(self, started: float, json_path: str | None, plot: str | None = None) -> int:
        """Record the plot and the run time, print the report, save it where asked; the exit status."""
        if plot:
            self.plots.append(plot)
        self.seconds = time.time() - started
        self.print()
        if json_path:
            self.save(json_path)
        return 0

    def print(self) -> None:
        for t in self.tables:
            print(t.text())
            print()
        for h in self.headlines:
            print(f"headline: {h}")


def load_report(path: str | Path) -> Report:
    data: dict[str, Any] = json.loads(Path(path).read_text())
    tables = [Table(**t) for t in data.pop("tables")]
    return Report(tables=tables, **data)


def fmt(cell: Cell) -> str:
    """Three significant figures for floats, so that tables stay narrow."""
    if cell is None:
        return "-"
    if isinstance(cell, bool | int | str):
        return str(cell)
    if math.isnan(cell) or math.isinf(cell):
        return str(cell)
    if cell == 0:
        return "0"
    if abs(cell) >= 1000:
        return f"{cell:,.0f}"
    return f"{cell:.3g}"


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else math.nan


def fit_exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y against log x: y ~ x^k gives k (nan with fewer than two points)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(pts) < 2:
        return math.nan
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    if den == 0:
        return math.nan
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> str:
    """Lay out, write (creating the folder) and close a figure; its path as text."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return str(path)


def bench_parser(doc: str | None, quick: str) -> argparse.ArgumentParser:
    """The arguments every benchmark takes: `--quick` (what it shrinks to) and `--json`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--json", help="write the report here")
    return parser


def plot_path(json_path: str | None, name: str) -> Path:
    """Where a benchmark writes its plot: beside its JSON report, else in bench/results."""
    folder = Path(json_path).resolve().parent if json_path else Path(__file__).resolve().parent / "results"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def unavailable(reason: str) -> str:
    """The cell text for a figure that could not be measured, with the reason."""
    return f"not available: {reason}"
