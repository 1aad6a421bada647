"""Every benchmark runs in its --quick mode and reports tables with the expected columns and finite numbers.

No timing is asserted: the figures are whatever this machine gives; only their presence and shape are.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

from tables import Table, fit_exponent, fmt, load_report  # noqa: E402


def run_quick(name: str, tmp_path: Path, *flags: str, timeout: float = 240.0) -> list[Table]:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), "--quick", "--json", str(out), *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = load_report(out)
    assert report.benchmark == name
    return report.tables


def numbers(table: Table, column: str) -> list[float]:
    """The column's cells, each required to be a finite number (a string says what was unavailable)."""
    k = table.columns.index(column)
    cells = [row[k] for row in table.rows]
    assert cells, f"{table.name}: no rows"
    for cell in cells:
        assert isinstance(cell, int | float) and not isinstance(cell, bool), f"{table.name} / {column}: {cell!r}"
        assert math.isfinite(cell), f"{table.name} / {column}: {cell!r}"
    return [float(c) for c in cells]


def only_table(tables: list[Table], prefix: str) -> Table:
    found = [t for t in tables if t.name.startswith(prefix)]
    assert len(found) == 1, [t.name for t in tables]
    return found[0]


# ------------------------------------------------------------------------------ helpers (fast)


def test_fit_exponent_recovers_a_power_law() -> None:
    xs = [8, 64, 512, 1024]
    assert fit_exponent(xs, [3 * x**1.5 for x in xs]) == pytest.approx(1.5)
    assert math.isnan(fit_exponent([8], [1.0]))


def test_table_formats_and_round_trips(tmp_path: Path) -> None:
    from tables import Report

    t = Table("t", ["a", "b"])
    t.add(1, 0.000123456)
    t.add("not available: x", None)
    with pytest.raises(ValueError):
        t.add(1)
    assert fmt(12345.6) == "12,346" and fmt(0.000123456) == "0.000123" and fmt(None) == "-"
    assert "| 1 | 0.000123 |" in t.markdown()
    Report("x", "X", [t]).save(tmp_path / "r.json")
    back = load_report(tmp_path / "r.json")
    assert back.tables[0].rows == t.rows
    assert json.loads((tmp_path / "r.json").read_text())["benchmark"] == "x"


# ------------------------------------------------------------------------------ benchmarks (quick)


@pytest.mark.slow
def test_plan_quality_quick(tmp_path: Path) -> None:
    tables = run_quick("plan_quality", tmp_path)
    t = only_table(tables, "Plan quality")
    for column in ("ours s", "data-parallel", "uniform", "time-balanced", "plan s"):
        assert column in t.columns
    assert all(x > 0 for x in numbers(t, "ours s"))
    # Our search considers every fitting baseline, so none can be faster in the same simulator.
    assert all(x >= 0.999 for x in numbers(t, "time-balanced"))


def test_plan_dimensions_quick(tmp_path: Path) -> None:
    tables = run_quick("plan_dimensions", tmp_path)
    times = only_table(tables, "Simulated iteration time")
    gains = only_table(tables, "Gain of each dimension")
    assert all(x > 0 for x in numbers(times, "full"))
    # The full search has every dimension the others lack, and ranks by the same simulator: taking one
    # away never makes the plan faster (the fixed-cost-blind plan is priced with the fixed cost).
    for column in ("no split", "no fixed cost"):
        assert all(x >= 0.999 for x in numbers(gains, column))


@pytest.mark.slow
def test_compile_time_quick(tmp_path: Path) -> None:
    tables = run_quick("compile_time", tmp_path)
    t = only_table(tables, "Compile time")
    for column in ("capture s", "plan s", "lower s", "emit s", "total s", "peak RSS MiB"):
        assert all(x >= 0 for x in numbers(t, column))
    growth = only_table(tables, "Growth of compile time")
    assert growth.columns[:2] == ["held fixed", "varied"]


@pytest.mark.slow
def test_memory_quick(tmp_path: Path) -> None:
    # Ranks as threads: the same runtime and memory meter without a torchrun start per row (four rows,
    # 10 s each on two cores); that torchrun reports each rank's peak, test_runtime_torchrun checks.
    t = only_table(run_quick("memory", tmp_path, "--transport", "threads"), "Peak memory per rank")
    assert {row[0] for row in t.rows} == {"gpipe", "1f1b", "zb-h1", "1f1b+recompute"}
    assert all(x > 0 for x in numbers(t, "measured peak KiB"))
    assert all(x > 0 for x in numbers(t, "predicted peak KiB"))


@pytest.mark.slow
def test_predicted_vs_measured_quick(tmp_path: Path) -> None:
    t = only_table(run_quick("predicted_vs_measured", tmp_path), "Simulated vs measured")
    assert all(x > 0 for x in numbers(t, "predicted s"))
    assert all(x > 0 for x in numbers(t, "measured s"))


@pytest.mark.slow
def test_runtime_vs_torch_pipelining_quick(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    tables = run_quick("runtime_vs_torch_pipelining", tmp_path, "--keep-runs", str(kept))
    t = only_table(tables, "Our runtime vs torch")
    assert all(x > 0 for x in numbers(t, "ours samples/s"))
    assert all(x > 0 for x in numbers(t, "torch samples/s"))
    assert all(x > 0 for x in numbers(t, "simulated / measured step"))
    for column in (
        "simulated with spread waiting % per rank",
        "simulated waiting % per rank, no slowdown",
        "replayed with measured transfers waiting % per rank",
        "simulated on shared cores waiting % per rank",
        "ours waiting for a peer % per rank",
    ):
        shares = [float(x) for row in t.rows for x in str(row[t.columns.index(column)]).split("/")]
        assert shares and all(0 <= x <= 100 for x in shares), (column, shares)
    # Every rank's receives after the first steps land in buffers it already has.
    reused = [
        cell
        for row in t.rows
        for cell in str(row[t.columns.index("ours receives into a reused buffer % per rank")]).split("/")
    ]
    assert reused and all(float(x) > 0 for x in reused), reused
    # Same seed, same data, same split: both sides compute the same first loss.
    for ours, theirs in zip(numbers(t, "step-0 loss ours"), numbers(t, "step-0 loss torch"), strict=True):
        assert ours == pytest.approx(theirs, rel=1e-5)
    ablation = only_table(tables, "What early receive posts, their headroom, reused receive buffers and pinned")
    assert all(x > 0 for x in numbers(ablation, "samples/s without early posts"))
    assert all(x > 0 for x in numbers(ablation, "samples/s without post headroom"))
    assert all(x > 0 for x in numbers(ablation, "samples/s without reused buffers"))
    assert all(x > 0 for x in numbers(ablation, "samples/s unpinned"))
    # Posting a receive early changes when it is issued, a reused buffer where it lands, and the cores a rank runs
    # on where it runs, never what arrives: the same losses.
    assert [row[ablation.columns.index("same step-0 loss")] for row in ablation.rows] == ["yes"]
    # The stored runs analysed again, every figure and simulation computed anew, give the same tables.
    (tmp_path / "again").mkdir()
    again = run_quick("runtime_vs_torch_pipelining", tmp_path / "again", "--from-runs", str(kept), timeout=120)
    assert [table.rows for table in again] == [table.rows for table in tables]
    assert any("--from-runs" in note for note in only_table(again, "Our runtime vs torch").notes)
    # The machine's own noise, measured before the cases, is quoted beside the steps' and stored with the runs.
    for measured in (t, only_table(again, "Our runtime vs torch")):
        assert any("the machine alone, measured before the cases" in note for note in measured.notes)


def test_runtime_bench_starts_no_case_past_its_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A case that would begin past the section's --budget is not run: its row says why, and the section still ends
    with its tables and headlines (run_all's hard limit would otherwise cut it off mid-case)."""
    import runtime_vs_torch_pipelining as rt

    monkeypatch.setattr(rt, "calibrated_figures", lambda device, procs: (1.0, dict.fromkeys(procs, 0.0)))
    monkeypatch.setattr(rt, "launch_case", lambda *args, **kwargs: pytest.fail("a case ran past the budget"))
    out = tmp_path / "rt.json"
    assert rt.main(["--quick", "--budget", "0", "--json", str(out)]) == 0
    table = only_table(load_report(out).tables, "Our runtime vs torch")
    assert len(table.rows) == 2
    assert all("--budget of 0 s was spent before the case began" in str(row[4]) for row in table.rows)


def test_runtime_bench_from_runs_names_the_folder_without_stored_runs(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "runtime_vs_torch_pipelining.py"), "--from-runs", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert f"--from-runs {tmp_path}: no bench.json there" in proc.stderr


def test_runtime_bench_fits_the_link_and_finds_the_waits() -> None:
    import runtime_vs_torch_pipelining as rt

    link = rt.fitted_link([(1e3, 1e-4 + 1e3 / 1e9), (1e6, 1e-4 + 1e6 / 1e9), (4e6, 1e-4 + 4e6 / 1e9)])
    assert link.latency == pytest.approx(1e-4) and link.bandwidth == pytest.approx(1e9)
    # One size: the mean, as least squares would give; a long tail (one transfer waiting for a core) moves it.
    one_size = rt.fitted_link([(64.0, 1e-4), (64.0, 1e-4), (64.0, 1e-4), (64.0, 9e-4)])
    assert (one_size.latency, one_size.bandwidth) == (pytest.approx(3e-4), math.inf)
    assert rt.worst_gap([0.40, 0.10], [0.30, 0.10]) == (pytest.approx(0.10), pytest.approx(1 / 3))
    assert rt.worst_gap([0.05], [0.0]) == (pytest.approx(0.05), math.inf)

    def span(kind: str, start: float, end: float, queued: float | None = None) -> dict[str, object]:
        return {"kind": kind, "start_s": start, "end_s": end, "stage": "s0", "queued_s": queued}

    # Each 1 s step: 0.1 s forward, a receive that costs 0.01 s but waits 0.5 s (0.2 s of it for a CPU, once its
    # data was there), 0.2 s backward, 0.05 s optimizer. The first receive queued too, but did not wait: its
    # queueing is part of what a receive costs, not of a wait.
    spans, step_times = [], {}
    for k in range(4):
        t = float(k)
        step_times[str(k)] = [t, t + 1.0]
        spans += [span("recv", t, t + 0.01, 0.005 * (k % 2)), span("forward", t + 0.01, t + 0.11, 0.03)]
        spans += [span("recv", t + 0.11, t + 0.62, 0.2), span("backward", t + 0.62, t + 0.82)]
        spans += [span("optimizer_step", t + 0.82, t + 0.87)]
    (costs,) = rt.rank_costs([{"rank": 0, "spans": spans, "step_times": step_times}], warmup=1)
    assert costs.busy_s == pytest.approx(0.5)
    assert costs.optimizer_s == pytest.approx(0.05)
    # Busy time beyond compute and the optimizer (the host's own work) scales the compute up.
    assert costs.work_factor == pytest.approx(0.45 / 0.3)
    # Of the 0.5 s waited per 1 s step, 0.2 s was a wait for a CPU.
    assert costs.queued_s == pytest.approx(0.2)
    assert rt.cpu_shares([{"rank": 0, "spans": spans, "step_times": step_times}], 1, [costs]) == pytest.approx([0.2])
    # On a core of its own: the forward less its 0.03 s in the run queue, the busy time likewise; the waits keep
    # theirs (a wait is not busy time to take it from).
    (solo,) = rt.rank_costs([{"rank": 0, "spans": spans, "step_times": step_times}], warmup=1, solo=True)
    assert solo.compute == {("forward", "s0"): pytest.approx(0.07), ("backward", "s0"): pytest.approx(0.2)}
    assert (solo.busy_s, solo.optimizer_s) == (pytest.approx(0.47), pytest.approx(0.05))


def test_runtime_bench_waiting_error_is_the_spread_of_the_bootstrapped_median() -> None:
    import runtime_vs_torch_pipelining as rt

    # Every step 1 s (the period); each rank posts a receive that finds its data (1 ms, the floor) and one that
    # waits. Rank 0 waits 0.1 s in odd steps and 0.3 s in even ones; rank 1 always 0.2 s. After the warm-up step,
    # 29 steps: 15 busy 0.9 s (k = 1, 3, ..., 29), 14 busy 0.7 s.
    period, floor, steps = 1.0, 0.001, 30

    def report(rank: int, wait: Any) -> dict[str, Any]:
        spans, step_times = [], {}
        for k in range(steps):
            t = k * period
            step_times[str(k)] = [t, t + period]
            spans += [{"kind": "recv", "start_s": t, "end_s": t + floor}]
            spans += [{"kind": "recv", "start_s": t + 0.5, "end_s": t + 0.5 + floor + wait(k)}]
        return {"rank": rank, "spans": spans, "step_times": step_times}

    reports = [report(0, lambda k: 0.1 if k % 2 else 0.3), report(1, lambda k: 0.2)]
    assert rt.measured_waiting([reports], 1) == pytest.approx([0.1, 0.2])
    errors = rt.waiting_error([rt.step_periods(reports, 1)], [rt.rank_costs(reports, 1)], draws=400)
    # A resample's median is 0.9 s (waiting 0.1) where it drew 15 or more of the 29 from the 15 steps busy 0.9 s,
    # else 0.7 s (waiting 0.3): its standard deviation is 0.2 sqrt(q (1 - q)), q that binomial chance. Rank 1's
    # waiting is the same in every resample.
    q = sum(math.comb(29, n) * (15 / 29) ** n * (14 / 29) ** (29 - n) for n in range(15, 30))
    assert errors[0] == pytest.approx(0.2 * math.sqrt(q * (1 - q)), rel=0.08)
    assert errors[1] == pytest.approx(0.0, abs=1e-12)
    # A gap of 0.15 points on rank 0 is 150 % of its 0.1 but under 2 standard errors: resolved as within; the
    # same gap on rank 1, 75 % of its 0.2 with no error, is not.
    assert rt.resolved_gap([0.25, 0.2], [0.1, 0.2], errors) == (pytest.approx(0.15 / errors[0]), True)
    gap, ok = rt.resolved_gap([0.1, 0.35], [0.1, 0.2], errors)
    assert gap > 1e6 and not ok
    # Steps of 1 s vary by nothing; steps ending 1, 2, ..., 5 s apart have quartiles 1.5, 3 and 4.5 s (the
    # exclusive method): an interquartile range of 3 s over a median of 3 s.
    assert rt.step_spread(reports, 1) == 0.0
    ends = [0.0, 1.0, 3.0, 6.0, 10.0, 15.0]
    steps = {str(k): [ends[k] - 0.5, ends[k]] for k in range(len(ends))}
    assert rt.step_spread([{"rank": 0, "spans": [], "step_times": steps}], 1) == pytest.approx(1.0)


def test_runtime_bench_shares_the_cores_it_is_told_of(tmp_path: Path) -> None:
    """`simulated_waiting` with `cores`: two ranks of measured costs on one core take, together, all their busy
    time per step (the closed form of one shared core: it never idles while either rank has work), where with a
    core each the step is shorter."""
    import runtime_vs_torch_pipelining as rt

    from dapple_ir.cluster.spec import Link
    from dapple_ir.sim.simulator import simulate

    module, durations = _modelled_plan(tmp_path, "1f1b")
    plan = tmp_path / "plan"
    free = Link(math.inf, 0.0)
    sim = simulate(module, cluster=rt._measured_cluster(2, free), durations=durations)
    reports = _as_measured(module, sim, 3)
    costs = rt.rank_costs(reports, 1)
    ((_, alone),) = rt.simulated_waiting(plan, costs, [(free, 1.0, 0.0)])
    ((shared_bubble, shared),) = rt.simulated_waiting(plan, costs, [(free, 1.0, 0.0)], cores=1)
    assert shared == pytest.approx(sum(c.busy_s for c in costs))
    assert alone == pytest.approx(sim.iteration_s) and alone < shared
    assert all(0.0 <= b < 1.0 for b in shared_bubble)


def test_run_all_renders_a_failed_benchmark_as_not_available(tmp_path: Path) -> None:
    import run_all

    bench = run_all.Bench("does_not_exist", 10)
    outcome = run_all.run_one(bench, quick=True, results=tmp_path)
    assert outcome.failure.startswith("not available")
    text = run_all.render([outcome], run_all.machine(), ("0", "0"), True, tmp_path / "B.md")
    assert "## Machine" in text and "not available" in text and "| cores |" in text
    # --reuse renders a benchmark from what the last run stored, and says so.
    run_all.save_outcome(outcome, tmp_path)
    again = run_all.stored_outcome(bench, tmp_path)
    assert again.failure == outcome.failure and again.reused_from
    assert "Stored result of the run that ended at" in run_all.render([again], [], ("0", "0"), False, tmp_path / "B.md")


def test_device_check_fails_fast_without_cuda() -> None:
    # Hiding every GPU makes this the no-CUDA case on any machine.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", str(BENCH / "device_check.sh")], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr


def _modelled_plan(tmp_path: Path, kind: str) -> tuple[Any, dict[tuple[int, int], float]]:
    """A 2-stage MLP plan of 4 microbatches and its instructions' times: forward 0.1 s, backward 0.2 s,
    optimizer step 0.05 s."""
    import runtime_vs_torch_pipelining as rt

    from dapple_ir.ir import InstrKind
    from tests.test_runtime import MLP, make_plan

    plan = make_plan(tmp_path / "plan", MLP, stages=2, kind=kind, microbatches=4)
    module = rt.parse_module((plan / "plan.dapple").read_text())
    modelled = {InstrKind.FORWARD: 0.1, InstrKind.BACKWARD: 0.2, InstrKind.OPTIMIZER_STEP: 0.05}
    durations = {
        (r, i): modelled[ins.kind]
        for r, p in enumerate(module.programs)
        for i, ins in enumerate(p.instrs)
        if ins.kind in modelled
    }
    return module, durations


def _as_measured(module: Any, sim: Any, steps: int) -> list[dict[str, Any]]:
    """The ranks' reports the runtime would write for `steps` simulated iterations one after the other: a span per
    instruction (a send's ends where it starts: the runtime hands it on, the simulator ends it at its arrival), a
    rank's step ending with its last instruction."""
    from dapple_ir.ir import InstrKind

    reports = []
    for r, p in enumerate(module.programs):
        spans, step_times = [], {}
        for k in range(steps):
            t0 = k * sim.iteration_s
            here = []
            for i, ins in enumerate(p.instrs):
                start, end = t0 + sim.starts[r][i], t0 + sim.ends[r][i]
                if ins.kind is InstrKind.SEND:
                    end = start
                stage = ins.stage.name if ins.stage else None
                span = {"kind": ins.kind.value, "index": i, "stage": stage, "peer": ins.peer}
                here.append({**span, "start_s": start, "end_s": end})
            step_times[str(k)] = [t0, max(sp["end_s"] for sp in here)]
            spans += here
        reports.append({"rank": r, "spans": spans, "step_times": step_times})
    return reports


def test_runtime_bench_replays_a_step_as_measured(tmp_path: Path) -> None:
    """A timeline the simulator made, handed to the bench as if measured, replays to the waiting it has, and the
    measured waiting read off it is the same: the replay adds or drops no time of its own."""
    import runtime_vs_torch_pipelining as rt

    from dapple_ir.cluster.spec import Link
    from dapple_ir.ir import InstrKind
    from dapple_ir.sim.simulator import simulate

    module, durations = _modelled_plan(tmp_path, "1f1b")
    link = Link(math.inf, 0.0)
    sim = simulate(module, cluster=rt._measured_cluster(2, link), durations=durations)
    assert max(sim.bubble_fraction) > 0.1  # a pipeline with waiting to find
    reports = _as_measured(module, sim, 3)
    steps = rt.step_durations(reports, 1)
    assert rt.replayed_waiting(module, steps, link) == pytest.approx(list(sim.bubble_fraction), abs=1e-9)
    # With its transfers' measured times too (here all 0 s: every receive posted, the link free).
    timed = rt.with_transfers(steps, rt.transfers(module, reports, 1), reports, 1)
    assert any(module.programs[r].instrs[i].kind is InstrKind.SEND for step in timed for r, i in step)
    assert rt.replayed_waiting(module, timed, link) == pytest.approx(list(sim.bubble_fraction), abs=1e-9)
    # Every step alike: whatever the draws, each instruction takes its one measured time.
    assert rt.spread_waiting(module, steps, link) == pytest.approx(list(sim.bubble_fraction), abs=1e-9)
    costs = rt.rank_costs(reports, 1)
    assert rt.waiting_shares(reports, 1, costs) == pytest.approx(list(sim.bubble_fraction), abs=1e-9)


def test_runtime_bench_replays_a_load_where_it_ran(tmp_path: Path) -> None:
    """A timeline whose loads take 0.05 s each (a step's global batch made at its first): the last stage loads its
    first targets while it waits for the first activation, so that load hides in the wait. The replay and the
    median-cost simulation time each load in place and find the simulated waiting; carried past the receive to the
    next forward, as the replay did before, the load would add to the last stage's chain and to both ranks' waiting."""
    import runtime_vs_torch_pipelining as rt

    from dapple_ir.cluster.spec import Link
    from dapple_ir.ir import InstrKind
    from dapple_ir.sim.simulator import simulate

    module, durations = _modelled_plan(tmp_path, "1f1b")
    loads = {
        (r, i): 0.05
        for r, p in enumerate(module.programs)
        for i, ins in enumerate(p.instrs)
        if ins.kind is InstrKind.LOAD_MICROBATCH
    }
    last = len(module.programs) - 1
    first_load = min(i for r, i in loads if r == last)
    assert module.programs[last].instrs[first_load + 1].kind is InstrKind.RECV  # a load before a wait
    link = Link(math.inf, 0.0)
    cluster = rt._measured_cluster(2, link)
    hidden = simulate(module, cluster=cluster, durations={**durations, (last, first_load): 0.05})
    assert hidden.iteration_s == pytest.approx(simulate(module, cluster=cluster, durations=durations).iteration_s)
    sim = simulate(module, cluster=cluster, durations={**durations, **loads})
    reports = _as_measured(module, sim, 3)
    steps = rt.step_durations(reports, 1)
    assert all(steps[0][key] == pytest.approx(0.05) for key in loads)
    assert rt.replayed_waiting(module, steps, link) == pytest.approx(list(sim.bubble_fraction), abs=1e-9)
    costs = rt.rank_costs(reports, 1)
    assert costs[last].loads[first_load] == pytest.approx(0.05)
    ((simulated, iteration),) = rt.simulated_waiting(tmp_path / "plan", costs, [(link, 1.0, 0.0)])
    assert iteration == pytest.approx(sim.iteration_s)
    assert simulated == pytest.approx(list(sim.bubble_fraction), abs=1e-9)


def test_runtime_bench_reads_every_transfer_off_a_timeline(tmp_path: Path) -> None:
    """A timeline the simulator made with a 10 ms link, handed to the bench as if measured: every transfer it reads
    off took one link time from its start (or two where the receive was posted after the send: the ready notice
    goes first), both link fits find it, and a receive whose data was there bounds its transfer from above."""
    import runtime_vs_torch_pipelining as rt

    from dapple_ir.analysis.peak_memory import recv_posts
    from dapple_ir.cluster.spec import Link
    from dapple_ir.ir import InstrKind
    from dapple_ir.sim.simulator import simulate

    module, durations = _modelled_plan(tmp_path, "gpipe")
    # Rank 1 computes 10x faster, so it waits for rank 0's activations, and rank 0 for some of its gradients
    # (others are there when it asks: spans of 0, the floor a wait is measured from)...
    durations = {(r, i): s / 10 if r == 1 else s for (r, i), s in durations.items()}
    # ...but its first forward is slow, so its next activation is there before its receive: a receive that does
    # not wait on each rank (the bench measures a wait from the rank's fastest receive).
    first = next(i for i, ins in enumerate(module.programs[1].instrs) if ins.kind is InstrKind.FORWARD)
    durations[(1, first)] = 0.35
    link = Link(math.inf, 0.01)
    sim = simulate(module, cluster=rt._measured_cluster(2, link), durations=durations)
    reports = _as_measured(module, sim, 1)
    found = rt.transfers(module, reports, 0)
    sends = sum(ins.kind is InstrKind.SEND for p in module.programs for ins in p.instrs)
    assert len(found) == sends
    exact = [t.seconds for t in found if t.landed]
    assert exact and all(s == pytest.approx(0.01) or s == pytest.approx(0.02) for s in exact)
    # A receive that found its data there bounds the transfer from above, loosely: from its start to the receive's.
    assert any(not t.landed for t in found) and all(t.seconds >= 0.01 - 1e-12 for t in found)
    idle = rt.fitted_link([(t.nbytes, t.seconds) for t in found if t.idle])
    assert 0.01 - 1e-9 <= idle.latency <= 0.02 + 1e-9
    assert any(recv_posts(module, p) for p in module.programs)  # early posts were read, not only at-the-recv ones
    # Replayed with its transfers' times as read, whatever link it is given, the timeline waits as it did.
    timed = rt.with_transfers(rt.step_durations(reports, 0), found, reports, 0)
    free = Link(math.inf, 0.0)
    assert rt.replayed_waiting(module, timed, free) == pytest.approx(list(sim.bubble_fraction), abs=1e-9)
    assert rt.replayed_waiting(module, rt.step_durations(reports, 0), free) != pytest.approx(list(sim.bubble_fraction))


def test_runtime_bench_starts_a_held_transfer_when_its_sender_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timeline the simulator made where transfers into a busy rank slow down (slowdown 4) and the ranks post at
    their receives: rank 1 computes twice as fast, so it sends gradients before rank 0 has posted their receives,
    and its transport answers those once the computation it runs when the notice comes is done
    (`_Simulator.answered_s`). Read from there, every transfer whose receiver blocked took one link time (10 ms) on
    its own; read from the post, as the bench did before, some took 100 ms."""
    import runtime_vs_torch_pipelining as rt

    from dapple_ir.analysis import peak_memory
    from dapple_ir.cluster.spec import Link
    from dapple_ir.sim.simulator import simulate

    monkeypatch.setattr(peak_memory, "post_headroom", lambda program, sizes: 0.0)
    module, durations = _modelled_plan(tmp_path, "gpipe")
    durations = {(r, i): s / 2 if r == 1 else s for (r, i), s in durations.items()}
    sim = simulate(module, cluster=rt._measured_cluster(2, Link(math.inf, 0.01), 4.0), durations=durations)
    reports = _as_measured(module, sim, 1)

    def blocked_alone() -> list[float]:
        return [t.seconds for t in rt.transfers(module, reports, 0) if t.landed and not t.busy_s]

    assert blocked_alone() and all(s == pytest.approx(0.01) for s in blocked_alone())
    monkeypatch.setattr(rt, "HOLDING", ())
    assert any(s == pytest.approx(0.1) for s in blocked_alone())


def test_runtime_bench_reads_the_woken_ranks_wait_for_a_core_off_a_timeline(tmp_path: Path) -> None:
    """A timeline the simulator made with a 10 ms link and a 4 ms wake (`wake_overhead`), handed to the bench as if
    measured, each receive that blocked runnable for its last 4 ms (`queued_s`, as the run-queue counters read a
    rank that waited for a core): the bench reads the wake back, leaves it out of the link's samples, and a replay
    with both waits as the timeline did; without the wake it waits less."""
    import runtime_vs_torch_pipelining as rt

    from dapple_ir.cluster.spec import Link
    from dapple_ir.ir import InstrKind
    from dapple_ir.sim.simulator import simulate

    module, durations = _modelled_plan(tmp_path, "gpipe")
    durations = {(r, i): s / 10 if r == 1 else s for (r, i), s in durations.items()}
    first = next(i for i, ins in enumerate(module.programs[1].instrs) if ins.kind is InstrKind.FORWARD)
    durations[(1, first)] = 0.35  # receives that find their data there: each rank's floor is 0
    link, wake = Link(math.inf, 0.01), 0.004
    sim = simulate(module, cluster=rt._measured_cluster(2, link, wake=wake), durations=durations)
    reports = _as_measured(module, sim, 1)
    blocked = 0
    for report in reports:
        for span in report["spans"]:
            if span["kind"] == "recv" and span["end_s"] > span["start_s"]:
                span["queued_s"], blocked = wake, blocked + 1
    assert blocked and rt.wake_overhead(reports, 0) == pytest.approx(wake)
    found = rt.transfers(module, reports, 0)
    samples = rt.link_samples(found)
    assert samples and all(s == pytest.approx(0.01) or s == pytest.approx(0.02) for _, s in samples)
    steps = rt.step_durations(reports, 0)
    assert rt.replayed_waiting(module, steps, link, 1.0, wake) == pytest.approx(list(sim.bubble_fraction), abs=1e-9)
    unwoken = rt.replayed_waiting(module, steps, link)
    assert all(u < w for u, w in zip(unwoken, sim.bubble_fraction, strict=True))


def test_busy_receive_slowdown_fit_against_hand_arithmetic() -> None:
    """A 0.1 s link. A began 0.2 s before its receive, all of it busy, and the receiver then waited 0.05 s: at
    slowdown s it moved 0.2 / s while the receiver computed, so 0.1 - 0.2 / s = 0.05 and s = 4. B began 0.5 s
    before, all busy, and was there first: at s = 4 it moved 0.125 >= 0.1, consistent. C met a waiting receiver
    and tells nothing. The waits add up at s = 4 alone."""
    import runtime_vs_torch_pipelining as rt

    from dapple_ir.cluster.spec import Link

    def transfer(seconds: float, landed: bool, idle: bool, before: float, busy: float) -> Any:
        return rt.Transfer(512.0, seconds, landed, idle, before, busy, step=0, rank=0, index=0)

    link = Link(math.inf, 0.1)
    a = transfer(0.25, True, False, 0.2, 0.2)
    b = transfer(0.5, False, False, 0.5, 0.5)
    c = transfer(0.1, True, True, 0.0, 0.0)
    assert rt.busy_receive_slowdown([a, b, c], link) == pytest.approx(4.0, rel=1e-9)
    # Half of A's lead spent waiting on something else (moving at full speed): 0.1 - 0.1 - 0.1 / s < 0.05 for any
    # s, so even a transfer that stops while its receiver computes waits less than measured: the fit's ceiling.
    assert rt.busy_receive_slowdown([transfer(0.25, True, False, 0.2, 0.1), c], link) == rt.MAX_BUSY_RECEIVE_SLOWDOWN
    # With B too, B's wait makes up the rest: max(0, 0.1 - 0.5 / s) = 0.05 at s = 10.
    assert rt.busy_receive_slowdown([transfer(0.25, True, False, 0.2, 0.1), b], link) == pytest.approx(10.0)
    # Nothing waited: the transfers are as fast into a busy receiver as into a waiting one.
    assert rt.busy_receive_slowdown([b, c], link) == 1.0


def test_runtime_bench_replays_a_timeline_made_with_a_busy_receivers_slowdown(tmp_path: Path) -> None:
    """A timeline the simulator made with transfers 4x slower into a computing receiver, handed to the bench as if
    measured: the replay with that slowdown gives back its waiting exactly; the replay without predicts less."""
    import runtime_vs_torch_pipelining as rt

    from dapple_ir.cluster.spec import Link
    from dapple_ir.ir import InstrKind
    from dapple_ir.sim.simulator import simulate

    module, durations = _modelled_plan(tmp_path, "gpipe")
    # Rank 1 computes 10x faster but starts slowly: rank 0's activations reach it while it computes.
    durations = {(r, i): s / 10 if r == 1 else s for (r, i), s in durations.items()}
    first = next(i for i, ins in enumerate(module.programs[1].instrs) if ins.kind is InstrKind.FORWARD)
    durations[(1, first)] = 0.35
    # 0.05 s per transfer, all of it bytes: no ready notice moves a transfer's start (a latency would).
    link = Link(10240.0, 0.0)
    sim = simulate(module, cluster=rt._measured_cluster(2, link, 4.0), durations=durations)
    reports = _as_measured(module, sim, 1)
    found = rt.transfers(module, reports, 0)
    assert {t.nbytes for t in found} == {512.0}
    assert any(not t.idle and t.busy_s > 0 for t in found)
    steps = rt.step_durations(reports, 0)
    assert rt.replayed_waiting(module, steps, link, 4.0) == pytest.approx(list(sim.bubble_fraction), abs=1e-9)
    plain = rt.replayed_waiting(module, steps, link)
    assert all(p <= s + 1e-12 for p, s in zip(plain, sim.bubble_fraction, strict=True))
    assert plain != pytest.approx(list(sim.bubble_fraction), abs=1e-3)


@pytest.mark.slow
def test_device_check_dry_run_on_cpu_passes_every_step() -> None:
    """bench/device_check.sh is what a lent GPU machine runs, once, with no second try: its CPU dry run must pass
    every step it can run here (its memory rows for M = 4 once failed to verify, unseen until a dry run)."""
    env = {**os.environ, "DEVICE_CHECK_DEVICE": "cpu", "PY": sys.executable}
    proc = subprocess.run(
        ["bash", str(BENCH / "device_check.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=540
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("runtime --check", "memory", "compile"))]
    assert len(rows) == 6, proc.stdout
    assert not [row for row in rows if "FAILED" in row], proc.stdout
    assert "PASS" in rows[0]
    # Every memory row's measured peak is the IR's prediction (+0 % on every rank).
    assert all(row.count("(+0%)") == 2 for row in rows if row.startswith("memory")), proc.stdout


def test_host_noise_figures_against_closed_forms() -> None:
    """`host_noise.noise_of` on made-up timings whose spread, autocorrelation and correlation are known."""
    from host_noise import noise_of

    n = 40
    # Pieces start every 2 s on every core, whatever they take: matched in time bins one piece wide, one a bin.
    steady = [(2.0 * i, 1.0) for i in range(n)]
    alternating = [(2.0 * i, 1.0 if i % 2 == 0 else 3.0) for i in range(n)]
    opposite = [(2.0 * i, 3.0 if i % 2 == 0 else 1.0) for i in range(n)]
    noise = noise_of({0: steady, 1: alternating})
    assert noise.pieces == [n, n]
    assert noise.spread[0] == 0.0
    # Half the pieces take 1, half 3: statistics.quantiles' quartiles are 1 and 3, the median 2.
    assert noise.spread[1] == pytest.approx((3 - 1) / 2)
    # An alternating series: every neighbour on the other side of the mean, lag-1 autocorrelation -(n-1)/n.
    assert noise.autocorrelation[1] == pytest.approx(-(n - 1) / n)
    assert noise.autocorrelation[0] == 0.0  # no variance, nothing to correlate
    assert noise_of({0: alternating, 1: alternating}).cross_correlation == pytest.approx(1.0)
    assert noise_of({0: alternating, 1: opposite}).cross_correlation == pytest.approx(-1.0)
    assert math.isnan(noise_of({0: alternating}).cross_correlation)


@pytest.mark.slow
def test_host_noise_times_every_core_at_once() -> None:
    from host_noise import MAX_CORES, measure_host_noise

    noise = measure_host_noise(seconds=0.3, chunk_s=0.005)
    cores = min(len(os.sched_getaffinity(0)), MAX_CORES)
    assert len(noise.spread) == len(noise.pieces) == cores
    assert all(p >= 3 for p in noise.pieces), noise.pieces
    assert all(0 <= s < 10 for s in noise.spread) and 0 < noise.chunk_s < 1
    assert "ms of work" in noise.summary()
