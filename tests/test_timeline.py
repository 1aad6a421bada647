"""Chrome trace writer/reader and the Gantt picture."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from dapple_ir.cli import main
from dapple_ir.ir import COMPUTE_KINDS, InstrKind
from dapple_ir.ir.printer import print_module
from dapple_ir.sim.drawing import draw_timeline, figure_size
from dapple_ir.sim.simulator import simulate
from dapple_ir.sim.trace import Span, Timeline, from_simulation, overlay, read_trace, write_trace
from dapple_ir.units import format_seconds
from tests.test_simulator import schedule_module, small_cluster

COMPUTE = COMPUTE_KINDS


def simulated_timeline(kind: str = "1f1b", stages: int = 2, microbatches: int = 4) -> tuple[Timeline, object]:
    module = schedule_module(kind, stages, microbatches, act_bytes=1000.0, out_bytes=1e6, microbatch_size=4)
    module.attrs.schedule = kind
    result = simulate(module, cluster=small_cluster(stages))
    return from_simulation(result), module


def test_trace_has_one_event_per_instruction(tmp_path: Path) -> None:
    timeline, module = simulated_timeline("zb-h1", 2, 4)
    write_trace(timeline, tmp_path / "t.json")
    document = json.loads((tmp_path / "t.json").read_text())
    events = document["traceEvents"]
    programs = module.programs  # type: ignore[attr-defined]
    compute = [e for e in events if e["ph"] == "X" and e["tid"] == 0]
    comm = [e for e in events if e["ph"] == "X" and e["tid"] >= 1]
    counters = [e for e in events if e["ph"] == "C"]
    names = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    # The first stage hands no gradient back: its input passes take no time and draw nothing.
    empty = sum(1 for i in programs[0].instrs if i.kind is InstrKind.BACKWARD_INPUT)
    assert empty == 4
    assert len(compute) == sum(1 for p in programs for i in p.instrs if i.kind in COMPUTE) - empty
    assert len(comm) == sum(1 for p in programs for i in p.instrs if i.kind is InstrKind.SEND)
    # One counter per allocation or release, plus the static level at time 0.
    memory_kinds = (InstrKind.FORWARD, InstrKind.RECV, InstrKind.FREE)
    changes = sum(1 for p in programs for i in p.instrs if i.kind in memory_kinds)
    assert len(counters) == changes + len(programs)
    assert sorted(e["args"]["name"] for e in names) == [f"rank {r} · dev {r} · s{r}" for r in range(len(programs))]
    assert {e["cat"] for e in compute} == {"forward", "backward_input", "backward_weight"}
    assert {e["name"] for e in compute if e["pid"] == 0} >= {"F0", "W0", "F3", "W3"}
    assert {e["name"] for e in compute if e["pid"] == 1} >= {"F0", "B0", "W0", "F3", "B3", "W3"}
    assert document["otherData"]["source"] == "simulated"
    for e in compute + comm:
        assert e["dur"] > 0 and e["ts"] >= 0 and 0 <= e["pid"] < len(programs)
    # Chrome's viewer needs the complete events of one thread not to overlap.
    for pid in range(len(programs)):
        for tid in {e["tid"] for e in compute + comm if e["pid"] == pid}:
            spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in compute + comm if (e["pid"], e["tid"]) == (pid, tid))
            assert all(a[1] <= b[0] + 1e-6 for a, b in itertools.pairwise(spans))


def test_read_trace_returns_what_was_written(tmp_path: Path) -> None:
    timeline, _ = simulated_timeline()
    write_trace(timeline, tmp_path / "t.json")
    back = read_trace(tmp_path / "t.json")
    assert back.ranks == timeline.ranks
    assert back.source == "simulated"
    assert back.iteration_s == timeline.iteration_s
    assert back.rank_labels == timeline.rank_labels
    assert back.metadata == timeline.metadata
    assert any(span.critical for span in back.spans)
    assert len(back.spans) == len(timeline.spans)
    for a, b in zip(sorted(back.spans, key=_order), sorted(timeline.spans, key=_order), strict=True):
        fields = ("rank", "track", "kind", "stage", "mb", "peer", "index", "critical")
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
        assert a.start_s == pytest.approx(b.start_s, abs=1e-9)
        assert a.end_s == pytest.approx(b.end_s, abs=1e-9)
    assert [(m.rank, m.bytes) for m in back.memory] == [(m.rank, m.bytes) for m in timeline.memory]
    assert all(span.queued_s is None for span in back.spans)  # a simulation has no run queue


def test_read_trace_keeps_the_measured_run_queue(tmp_path: Path) -> None:
    spans = [Span(0, "compute", "forward", 0.0, 0.5, "s0", 0, queued_s=0.125), Span(0, "comm", "recv", 0.5, 0.75)]
    write_trace(Timeline(1, spans, [], "measured", 0.75), tmp_path / "m.json")
    back = {s.kind: s.queued_s for s in read_trace(tmp_path / "m.json").spans}
    assert back == {"forward": 0.125, "recv": None}


def _order(span: object) -> tuple:
    return (span.rank, span.track, span.start_s, span.kind)  # type: ignore[attr-defined]


def test_read_trace_accepts_a_minimal_measured_trace(tmp_path: Path) -> None:
    """What a runtime writes may carry fewer fields: kind falls back to the category, source to measured."""
    events = [
        {"ph": "X", "name": "F0", "cat": "forward", "pid": 1, "tid": 0, "ts": 10.0, "dur": 5.0},
        {"ph": "C", "name": "memory", "pid": 1, "ts": 10.0, "args": {"bytes": 42}},
    ]
    (tmp_path / "m.json").write_text(json.dumps({"traceEvents": events}))
    timeline = read_trace(tmp_path / "m.json")
    assert timeline.ranks == 2 and timeline.source == "measured"
    (span,) = timeline.spans
    assert (span.kind, span.rank, span.track) == ("forward", 1, "compute")
    assert (span.start_s, span.end_s) == pytest.approx((10e-6, 15e-6))
    assert timeline.iteration_s == pytest.approx(15e-6)
    assert timeline.memory[0].bytes == 42


def test_png_has_the_promised_size(tmp_path: Path) -> None:
    from matplotlib import image

    timeline, _ = simulated_timeline("1f1b", 4, 8)
    size = draw_timeline(timeline, tmp_path / "t.png")
    assert size == figure_size(4) == (1600, 540)
    assert (tmp_path / "t.png").stat().st_size > 10_000
    pixels = image.imread(tmp_path / "t.png")
    assert pixels.shape[:2] == (size[1], size[0])
    assert pixels.std() > 0.05  # not a blank canvas


def test_cli_writes_summary_trace_and_picture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    module = schedule_module("1f1b", 3, 6, out_bytes=1e6)
    plan = tmp_path / "plan"
    plan.mkdir()
    (plan / "plan.dapple").write_text(print_module(module))
    assert main(["simulate", str(plan), "--cluster", "1x4xV100-16GB"]) == 0
    out = capsys.readouterr().out
    assert "iteration" in out and "bubble" in out
    assert len([line for line in out.splitlines() if line.strip().startswith(("0 ", "1 ", "2 "))]) == 3
    assert (plan / "timeline.png").stat().st_size > 0
    trace = read_trace(plan / "timeline.json")
    assert trace.ranks == 3
    assert trace.metadata["cluster"] == "1x4xV100-16GB"


def test_cli_steady_prints_the_period_of_back_to_back_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--steady` simulates back-to-back steps (`simulate(steady=True)`): the summary's iteration is their period.
    zb-h1 over 2 stages, 2 microbatches, the last stage's backward twice as long: that stage ends its step 1 s after
    the first, whose next step starts meanwhile, so the period (10 s) is 1 s below the first step's 11 s (the
    arithmetic of such a step: tests/test_simulator.py)."""
    module = schedule_module("zb-h1", 2, 2, out_bytes=1e6)
    module.stages[1].ops[0].attrs.bwd_s = 4.0
    (tmp_path / "p.dapple").write_text(print_module(module))
    first = simulate(module, cluster="1x4xV100-16GB")
    steady = simulate(module, cluster="1x4xV100-16GB", steady=True)
    assert steady.iteration_s == pytest.approx(first.iteration_s - 1.0)
    assert main(["simulate", str(tmp_path / "p.dapple"), "--cluster", "1x4xV100-16GB", "--steady", "--no-picture"]) == 0
    out = capsys.readouterr().out
    assert "steady state" in out and f"iteration {format_seconds(steady.iteration_s)}" in out
    assert read_trace(tmp_path / "timeline.json").ranks == 2


def test_cli_ir_file_with_output_dir_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "p.dapple").write_text(print_module(schedule_module("gpipe", 2, 2)))
    assert main(["simulate", str(tmp_path / "p.dapple"), "-o", str(tmp_path / "out"), "--no-picture"]) == 0
    assert (tmp_path / "out" / "timeline.json").is_file()
    assert not (tmp_path / "out" / "timeline.png").exists()
    assert "communication is free" in capsys.readouterr().err
    assert main(["simulate", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def measured_copy(timeline: Timeline, stretch: float, clock: float) -> Timeline:
    """A stand-in for a runtime's trace: the same spans, `stretch` times longer, on a wall clock at `clock`."""
    spans = [replace(s, start_s=clock + s.start_s * stretch, end_s=clock + s.end_s * stretch) for s in timeline.spans]
    memory = [replace(m, time_s=clock + m.time_s * stretch) for m in timeline.memory]
    return Timeline(timeline.ranks, spans, memory, "measured", timeline.iteration_s * stretch, [], {})


def test_overlay_puts_measured_under_predicted() -> None:
    predicted, _ = simulated_timeline("1f1b", 2, 4)
    both = overlay(predicted, measured_copy(predicted, 2.0, 100.0))
    assert both.ranks == 4
    assert both.rank_labels == ["rank 0 simulated", "rank 0 measured", "rank 1 simulated", "rank 1 measured"]
    rows = {r: sorted(s.start_s for s in both.spans if s.rank == r) for r in range(4)}
    assert rows[1] == pytest.approx([2 * t for t in rows[0]])
    assert rows[3] == pytest.approx([2 * t for t in rows[2]])
    assert both.iteration_s == pytest.approx(2 * predicted.iteration_s)


def test_cli_compares_with_a_measured_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "p.dapple").write_text(print_module(schedule_module("1f1b", 2, 4)))
    predicted = from_simulation(simulate(tmp_path / "p.dapple"))
    write_trace(measured_copy(predicted, 1.25, 7.0), tmp_path / "measured.json")
    argv = ["simulate", str(tmp_path / "p.dapple"), "--no-picture", "--compare", str(tmp_path / "measured.json")]
    assert main(argv) == 0
    assert "measured / predicted = 1.250" in capsys.readouterr().out
    assert (tmp_path / "timeline-compare.png").stat().st_size > 0
