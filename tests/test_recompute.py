"""Activation recomputation per stage: the IR attribute, the simulator and the cost model against closed
forms, the memory model, and the planner's per-stage choice against an exhaustive search."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from pathlib import Path

import pytest
import torch

from dapple_ir.analysis.peak_memory import loaded_bytes
from dapple_ir.backends.torch.launch import run
from dapple_ir.backends.torch.reference import train_reference
from dapple_ir.backends.torch.tolerances import ATOL, RTOL
from dapple_ir.errors import PlanError
from dapple_ir.ir.parser import parse_module
from dapple_ir.ir.printer import print_module
from dapple_ir.ir.verifier import verify_module
from dapple_ir.passes.plan import lower_and_simulate
from dapple_ir.plan_dir import load_plan
from dapple_ir.planner.baselines import time_balanced_partition
from dapple_ir.planner.cost_model import Problem, candidate, evaluate, stage_memory
from dapple_ir.planner.recompute import recut
from dapple_ir.planner.search import Request, search, trim_recompute
from dapple_ir.sim.simulator import simulate
from tests.test_exactness import DROPOUT_MODEL, _spec
from tests.test_planner_exact import _ideal
from tests.test_runtime import CNN, make_plan
from tests.test_simulator import schedule_module
from tests.test_virtual_stages import BERT48, _coarsened, _planned


def _recomputing(module, stages=None):  # type: ignore[no-untyped-def]
    for k, stage in enumerate(module.stages):
        if stages is None or k in stages:
            stage.attrs.recompute = True
    return module


def test_recompute_round_trips_through_the_text_form() -> None:
    module = _recomputing(schedule_module("1f1b", 3, 4), {0, 2})
    verify_module(module)
    text = print_module(module)
    assert text.count("recompute = true") == 2
    again = parse_module(text)
    assert [s.recompute for s in again.stages] == [True, False, True]
    assert print_module(again) == text


# ------------------------------------------------------------------------------ closed forms


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), [(1, 4), (2, 4), (3, 5), (4, 8)])
def test_simulated_recompute_everywhere_is_the_closed_form(kind: str, stages: int, microbatches: int) -> None:
    """Equal stages recomputing everywhere, free communication: (M + S - 1)(2F + B)."""
    f, b = 1.0, 2.0
    module = _recomputing(schedule_module(kind, stages, microbatches, fwd_s=f, bwd_s=b))
    assert simulate(module).iteration_s == pytest.approx((microbatches + stages - 1) * (2 * f + b))


@pytest.mark.parametrize(("stages", "m"), [(2, 4), (4, 8), (4, 16)])
def test_estimated_recompute_everywhere_is_the_closed_form(stages: int, m: int) -> None:
    f, b = 0.01, 0.02
    problem = Problem(
        [f] * stages, [b] * stages, [1.0] * stages, [0.0] * stages, [0.0] * stages, [0.0] * stages,
        _ideal(1, 8), global_batch=m, cost_batch=1, batch=1,
    )  # fmt: skip
    cand = candidate(problem, list(range(stages + 1)), [1] * stages, m, "1f1b", "append-first", "t")
    assert cand is not None
    everywhere = dataclasses.replace(cand, recompute=(True,) * stages)
    assert evaluate(problem, cand).iteration_s == pytest.approx((m + stages - 1) * (f + b))
    assert evaluate(problem, everywhere).iteration_s == pytest.approx((m + stages - 1) * (2 * f + b))


# -------------------------------------------------------------------------------- memory


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_a_recomputing_stage_holds_one_microbatch_of_activations(kind: str) -> None:
    """Without recomputation stage s holds min(S - s, M) (1f1b) or M (gpipe) microbatches' activations;
    recomputing, only the one its backward reruns, and its inputs per microbatch in flight: the first
    stage's loaded input x (f32[8,4], saved again by the rerun, so counted once there), the second's
    received tensor as a transfer (zero bytes here)."""
    act, stages, m = 1000.0, 4, 8
    plain = simulate(schedule_module(kind, stages, m, act_bytes=act)).peak_bytes
    module = _recomputing(schedule_module(kind, stages, m, act_bytes=act), {0, 1})
    rerun = simulate(module).peak_bytes
    x = loaded_bytes(module, module.stages[0])
    held = m if kind == "gpipe" else stages
    assert x == 8 * 4 * 4 and loaded_bytes(module, module.stages[1]) == 0.0
    assert rerun[:2] == [held * x + act - x, act]
    assert rerun[2:] == plain[2:]
    assert plain[0] == act * held


def test_cost_model_memory_keeps_inputs_per_microbatch_in_flight() -> None:
    problem = Problem(
        [1.0] * 3, [2.0] * 3, [100.0] * 3, [10.0] * 3, [0.0] * 3, [7.0, 7.0, 0.0],
        _ideal(1, 4), global_batch=8, cost_batch=1, batch=1,
    )  # fmt: skip
    # Layers 1-2, 2 stages from the end, 8 microbatches of 1: 2 in flight under 1f1b, 8 under gpipe.
    assert stage_memory(problem, 1, 3, "1f1b", 2, 8, 1) == 20.0 + 2 * 200.0
    assert stage_memory(problem, 1, 3, "1f1b", 2, 8, 1, recompute=True) == 20.0 + 2 * 7.0 + 200.0
    assert stage_memory(problem, 1, 3, "gpipe", 2, 8, 1, recompute=True) == 20.0 + 8 * 7.0 + 200.0
    assert stage_memory(problem, 0, 1, "1f1b", 3, 8, 1, recompute=True) == 10.0 + 0.0 + 100.0


# ------------------------------------------------------------------------------ the planner


def _tight_problem(capacity_share: float) -> Problem:
    """Four unequal layers, each sample's activations over half a device: a stage before the last holds
    two microbatches in flight (8 microbatches, at most 4 replicas), so only recomputation fits."""
    cluster = _ideal(1, 4)
    cap = cluster.device(0).memory_bytes
    act = [0.6 * cap, 0.55 * cap, 0.6 * cap, 0.5 * cap]
    return Problem(
        [0.01, 0.02, 0.015, 0.01], [0.02, 0.04, 0.03, 0.02], act, [capacity_share * cap] * 4, [0.0] * 4,
        [0.001 * cap] * 4, cluster, global_batch=8, cost_batch=1, batch=1,
    )  # fmt: skip


def test_trimmed_recompute_is_the_fastest_fitting_choice_of_all_subsets() -> None:
    problem = _tight_problem(0.05)
    checked = 0
    for bounds, schedule, m in itertools.product(([0, 1, 2, 3, 4], [0, 2, 4]), ("1f1b", "gpipe"), (2, 8)):
        n = len(bounds) - 1
        cand = candidate(problem, bounds, [1] * n, m, schedule, "append-first", "t")
        assert cand is not None
        fitting = []
        for choice in itertools.product((False, True), repeat=n):
            est = evaluate(problem, dataclasses.replace(cand, recompute=choice))
            if est.fits:
                fitting.append(est.iteration_s)
        trimmed = trim_recompute(problem, cand, everywhere=True)
        if not fitting:
            assert trimmed is None
            continue
        assert trimmed is not None and trimmed.estimate.fits
        assert trimmed.estimate.iteration_s == pytest.approx(min(fitting))
        checked += 1
    assert checked == 2  # the 4-stage plans of microbatches of 1; the others fit in no way


def _stage_work(problem: Problem, cand, k: int) -> float:  # type: ignore[no-untyped-def]
    """Stage k's busy seconds per iteration from the problem's layer times (no host work or links on `_ideal`):
    its microbatches x (F + B, plus F again where it recomputes)."""
    st = cand.stages[k]
    b = problem.microbatch_size(cand.microbatches)
    scale = b / problem.cost_batch
    fwd = sum(problem.fwd_s[st.lo : st.hi]) * scale
    bwd = sum(problem.bwd_s[st.lo : st.hi]) * scale
    return -(-cand.microbatches // st.replicas) * (fwd + bwd + (fwd if cand.recomputes(k) else 0.0))


def test_recut_finds_the_least_busiest_stage_of_all_cuts_and_recompute_choices() -> None:
    """`recut` against every cut of 8 unequal layers into 3 stages and every subset of recomputing stages: the
    busiest stage's work is the least any fitting choice gives, and a stage recomputes only where it must."""
    cluster = _ideal(1, 3)
    cap = cluster.device(0).memory_bytes
    layers = 8
    fwd = [0.010, 0.014, 0.008, 0.012, 0.016, 0.009, 0.011, 0.013]
    act = [f * cap for f in (0.4, 0.3, 0.25, 0.3, 0.35, 0.2, 0.3, 0.25)]
    problem = Problem(
        fwd, [2 * f for f in fwd], act, [0.03 * cap] * layers, [0.0] * layers, [0.0] * layers, cluster,
        global_batch=8, cost_batch=1, batch=1,
    )  # fmt: skip
    start = candidate(problem, [0, 3, 6, 8], [1, 1, 1], 8, "1f1b", "append-first", "t")
    assert start is not None
    best, fitting_without = float("inf"), 0
    for lo, hi in itertools.combinations(range(1, layers), 2):
        spans = [(0, lo), (lo, hi), (hi, layers)]
        stages = tuple(dataclasses.replace(st, lo=a, hi=b) for st, (a, b) in zip(start.stages, spans, strict=True))
        cand = dataclasses.replace(start, stages=stages)
        fitting_without += evaluate(problem, cand).fits
        for choice in itertools.product((False, True), repeat=3):
            chosen = dataclasses.replace(cand, recompute=choice)
            if evaluate(problem, chosen).fits:
                best = min(best, max(_stage_work(problem, chosen, k) for k in range(3)))
    # The first stage holds 3 microbatches in flight: every layer's take 1.2 devices without recomputation.
    assert fitting_without == 0
    found = recut(problem, dataclasses.replace(start, recompute=(True, True, True)))
    assert found is not None and evaluate(problem, found).fits
    assert max(_stage_work(problem, found, k) for k in range(3)) == pytest.approx(best, rel=1e-3)
    assert any(found.recompute) and not all(found.recompute)
    for k in range(3):
        if found.recomputes(k):
            flags = tuple(found.recomputes(j) and j != k for j in range(3))
            assert evaluate(problem, dataclasses.replace(found, recompute=flags)).stage_peak_bytes[k] > cap


def test_auto_recomputes_only_where_the_plan_needs_it() -> None:
    problem = _tight_problem(0.05)
    with pytest.raises(PlanError, match="--recompute auto"):
        search(problem, Request(recompute="none"))
    chosen = search(problem, Request()).chosen
    assert chosen.estimate.fits and any(chosen.cand.recompute)
    # Every recomputing stage needs it: without, it would not fit.
    without = evaluate(problem, dataclasses.replace(chosen.cand, recompute=()))
    for k, (peak, cap) in enumerate(zip(without.stage_peak_bytes, without.stage_capacity, strict=True)):
        assert chosen.cand.recomputes(k) == (peak > cap)
    everywhere = search(problem, Request(recompute="all")).chosen
    assert all(everywhere.cand.recomputes(k) for k in range(len(everywhere.cand.stages)))


def test_auto_does_not_recompute_when_the_plan_fits() -> None:
    problem = _tight_problem(0.0)
    cap = problem.capacity(0)
    roomy = dataclasses.replace(problem, act_bytes=[a * 1e-3 for a in problem.act_bytes])
    assert roomy.capacity(0) == cap
    assert not any(search(roomy, Request()).chosen.cand.recompute)


def test_bad_recompute_requests_name_the_culprit() -> None:
    with pytest.raises(PlanError, match="recompute must be one of auto, none, all, not 'some'"):
        search(_tight_problem(0.05), Request(recompute="some"))
    with pytest.raises(PlanError, match="recompute=all is modelled for the 1f1b, gpipe and interleaved schedules"):
        search(_tight_problem(0.05), Request(recompute="all", schedule="zb-h1"))


def test_estimate_agrees_with_the_simulator_with_recompute() -> None:
    """Time-balanced pipelines of 2, 4 and 8 stages, M = S and 4S, recomputing everywhere or on every
    other stage: the model's time within 15% of the simulated one; recomputing is slower and lighter."""
    module, problem = _coarsened(BERT48, "1x8xV100-16GB", 64)
    checked = 0
    for groups, per_stage in itertools.product((2, 4, 8), (1, 4)):
        bounds = time_balanced_partition(problem, groups) or []
        base = candidate(problem, bounds, [1] * groups, per_stage * groups, "1f1b", "append-first", "t")
        assert base is not None
        plain_s, plain_peak = lower_and_simulate(module, problem, base)
        for choice in ((True,) * groups, tuple(k % 2 == 0 for k in range(groups))):
            cand = dataclasses.replace(base, recompute=choice)
            simulated, peak = lower_and_simulate(module, problem, cand)
            assert evaluate(problem, cand).iteration_s == pytest.approx(simulated, rel=0.15), cand.describe()
            assert simulated > plain_s and peak < plain_peak
            checked += 1
    assert checked == 12


def test_plan_pass_writes_recompute_and_explain_lists_it() -> None:
    module, ctx = _planned(BERT48, "recompute=all,method=dp,stages=4", "1x8xV100-16GB", 64, lower=True)
    assert len(module.stages) == 4 and all(s.recompute for s in module.stages)
    chosen = next(line for line in ctx.reports["plan"] if line.endswith("CHOSEN"))
    assert " s0,s1,s2,s3 " in chosen and ctx.reports["plan"][-1].count("recomputing") == 4
    assert "recompute" in ctx.reports["plan"][1]


# -------------------------------------------------------------------------------- the runtime


@pytest.mark.parametrize(
    ("stages", "replicas", "kind", "recompute"),
    [
        pytest.param(2, None, "1f1b", (0,), id="1f1b-first-stage"),
        pytest.param(3, None, "1f1b", (0, 1, 2), id="1f1b-every-stage"),
        pytest.param(2, [1, 2], "gpipe", (1,), id="gpipe-replicated-last-stage"),
        pytest.param(2, None, "zb-h1", (0, 1), id="split-backward"),
    ],
)
def test_recomputing_stages_train_exactly_with_dropout(
    tmp_path: Path, stages: int, replicas: list[int] | None, kind: str, recompute: tuple[int, ...]
) -> None:
    """Dropout masks drawn again by the rerun forward are the same (seeded by op, step and microbatch):
    the pipeline trains to the single-device reference's parameters."""
    spec = _spec(tmp_path, "dropout", DROPOUT_MODEL)
    plan = make_plan(
        tmp_path / "plan", spec, stages=stages, replicas=replicas, kind=kind, optimizer="adam", lr=1e-2,
        recompute=recompute,
    )  # fmt: skip
    assert [s.recompute for s in load_plan(plan).module.stages] == [k in recompute for k in range(stages)]
    result = run(plan, steps=3, check=True, transport="threads", timeout=30)
    assert result.check is not None and result.check.ok, result.check
    assert result.check.max_loss_diff <= ATOL


def test_recomputing_batch_norm_updates_its_statistics_once(tmp_path: Path) -> None:
    """The rerun forward runs in training mode too, but batch norm's running statistics and batch count
    are updated once per microbatch, as on one device: the buffers equal the reference's."""
    plan = make_plan(tmp_path / "plan", CNN, stages=2, kind="1f1b", optimizer="adam", lr=1e-3, recompute=(0, 1))
    result = run(plan, steps=2, check=True, transport="threads", timeout=30)
    assert result.check is not None and result.check.ok, result.check
    ref = train_reference(CNN, seed=0, steps=2, microbatches=4, microbatch_size=2, optimizer="adam", lr=1e-3)
    held = {key.split("/", 1)[1]: value for tensors in result.buffers.values() for key, value in tensors.items()}
    assert held.keys() == ref.buffers.keys()
    for name, value in held.items():
        torch.testing.assert_close(value, ref.buffers[name], rtol=RTOL, atol=ATOL)
    assert int(held["stem.1.num_batches_tracked"]) == 2 * 4


def test_recomputation_lowers_the_measured_activation_peak(tmp_path: Path) -> None:
    """The runtime's memory meter (bytes it holds, each storage once) of the first of four 1f1b stages,
    which holds four microbatches in flight: recomputing, it keeps only their inputs."""
    spec = _spec(tmp_path, "dropout", DROPOUT_MODEL)
    peaks, predicted = [], []
    for recompute in ((), (0,)):
        plan = make_plan(
            tmp_path / f"plan{len(recompute)}", spec, stages=4, microbatches=8, microbatch_size=64, recompute=recompute
        )
        result = run(plan, steps=1, transport="threads", timeout=30)
        peaks.append(result.peak_bytes[0])
        predicted.append(load_plan(plan).module.programs[0].attrs.peak_bytes)
    assert peaks[1] < peaks[0]
    assert predicted[1] is not None and predicted[0] is not None and predicted[1] < predicted[0]


# ------------------------------------------------------------------------------- Llama-2-70B


@pytest.mark.slow
def test_llama_2_70b_plans_on_8x8xh100_only_with_recomputation() -> None:
    """Llama-2-70B at sequence 2048, example batch 4 (captured on the meta device): about 212 GiB of
    activations per sample and 1 TiB of parameters, gradients and Adam state on 64 x 80 GB.

    Proven: the DP finds no plan without recomputation at any microbatch count, and its memory
    advice, having planned with recomputation (every count, cost model), says one fits. Then, with
    the microbatch count forced to 64 (one sample each: the fewest activations in flight, and the
    count the unforced search chooses too), the search ranked by the simulator, as `dapple compile`
    does, picks a plan that recomputes and would not fit without, and the lowered plan's simulated
    peak fits. Forcing the count keeps the simulated search to one count's candidates (13 s, not 30 s)."""
    from dapple_ir.cluster.toml_file import resolve_cluster
    from dapple_ir.frontend.spec_loader import capture_spec
    from dapple_ir.pass_manager import PassManager, build_pipeline
    from dapple_ir.planner.cost_model import problem_from_module
    from dapple_ir.registry import PassContext
    from tests.paths import ROOT

    module = capture_spec(f"{ROOT / 'examples' / 'llama.py'}:factory_70b", device="meta")
    module.attrs.global_batch, module.attrs.optimizer = 64, "adam"
    PassManager(build_pipeline("annotate-cost,coarsen")).run(module, PassContext(cluster="8x8xH100"))
    problem = problem_from_module(module, resolve_cluster("8x8xH100"), 64)
    assert sum(problem.act_bytes) / problem.cost_batch > 200 * 2**30
    with pytest.raises(PlanError, match="It fits on 8x8xH100 with --recompute auto"):
        search(problem, Request(method="dp", recompute="none"))
    # Ranked by the simulator, as `dapple compile` does: the plan chosen runs as the model says.
    score = functools.partial(lower_and_simulate, module)
    chosen = search(problem, Request(microbatches=64), score).chosen
    assert chosen.cand.microbatches == 64
    assert chosen.estimate.fits and any(chosen.cand.recompute)
    assert not evaluate(problem, dataclasses.replace(chosen.cand, recompute=())).fits
    assert chosen.simulated_s is not None and chosen.simulated_peak is not None
    assert chosen.simulated_peak <= problem.capacity(0)
    assert chosen.estimate.iteration_s == pytest.approx(chosen.simulated_s, rel=0.15)


def test_compile_recompute_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dapple_ir.cli import main

    common = [f"profile:{BERT48}", "--cluster", "1x8xV100-16GB", "--global-batch", "64", "--planner", "dp"]
    assert main(["compile", *common, "--stages", "2", "--recompute", "all", "-o", str(tmp_path / "all")]) == 0
    assert (tmp_path / "all" / "plan.dapple").read_text().count("recompute = true") == 2
    assert main(["compile", *common, "--recompute", "none", "-o", str(tmp_path / "none"), "--explain"]) == 0
    assert "recompute = true" not in (tmp_path / "none" / "plan.dapple").read_text()
    out = capsys.readouterr().out
    assert "recompute" in out and "rc s" not in out
    with pytest.raises(SystemExit) as exited:
        main(["compile", *common, "--recompute", "some", "-o", str(tmp_path / "bad")])
    assert exited.value.code == 2
    assert "argument --recompute: invalid choice: 'some'" in capsys.readouterr().err
