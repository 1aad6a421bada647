"""The memory advice: one answer, computed from the planner's own memory model, that the planner then
accepts. The fewest-devices bound is checked against an exhaustive search over the cost model; the
advice by planning what it says, and the next smaller cluster (or microbatch count)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from pathlib import Path

import pytest

from dapple_ir.api import compile as compile_plan
from dapple_ir.cluster.spec import parse_shorthand
from dapple_ir.errors import DappleError, PlanError
from dapple_ir.planner.cost_model import Problem, candidate, evaluate
from dapple_ir.planner.memory_fit import leanest_plan, tightest_layer
from dapple_ir.planner.search import MemoryAdvice, Request, memory_advice, search
from tests.pipeline_fixtures import write_chain_profile

GB = 1e9


def _problem(
    layers: int,
    static: float | list[float],
    act_per_sample: float | list[float],
    cluster: str,
    global_batch: int = 64,
) -> Problem:
    statics = static if isinstance(static, list) else [static] * layers
    acts = act_per_sample if isinstance(act_per_sample, list) else [act_per_sample] * layers
    return Problem(
        fwd_s=[0.01] * layers,
        bwd_s=[0.02] * layers,
        act_bytes=acts,
        static_bytes=statics,
        grad_bytes=[s / 4 for s in statics],
        cut_bytes=[*([1e6] * (layers - 1)), 0.0],
        cluster=parse_shorthand(cluster),
        global_batch=global_batch,
        cost_batch=1,
        batch=1,
        names=[f"node{i}" for i in range(layers)],
    )


def _on(problem: Problem, cluster: str) -> Problem:
    return dataclasses.replace(problem, cluster=parse_shorthand(cluster))


def _plans(problem: Problem, req: Request) -> bool:
    try:
        search(problem, req, advise=False)
    except PlanError:
        return False
    return True


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ------------------------------------------------------------------------ the fewest-devices bound


def _fewest_by_exhaustion(problem: Problem, microbatches: int, schedule: str, stages: int | None) -> float:
    """Every contiguous partition x every replica vector up to M per stage, by the cost model."""
    layers, best = problem.layers, math.inf
    for s in range(1, layers + 1):
        if stages is not None and s != stages:
            continue
        for cuts in itertools.combinations(range(1, layers), s - 1):
            bounds = [0, *cuts, layers]
            for reps in itertools.product(range(1, microbatches + 1), repeat=s):
                if sum(reps) >= best:
                    continue
                cand = candidate(problem, bounds, list(reps), microbatches, schedule, "append-first", "exhaustive")
                if cand is not None and evaluate(problem, cand).fits:
                    best = sum(reps)
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved"])
def test_leanest_plan_is_the_fewest_devices_any_candidate_fits_on(seed: int, schedule: str) -> None:
    rng = random.Random(seed)
    layers, cap = 4, 16 * GB
    problem = _problem(
        layers,
        [rng.uniform(0.1, 0.6) * cap for _ in range(layers)],
        [rng.uniform(0.01, 0.3) * cap for _ in range(layers)],
        "1x64xV100-16GB",
        global_batch=6,
    )
    stages = rng.choice([None, None, 2])
    for m in _divisors(problem.global_batch):
        lean = leanest_plan(problem, m, schedule, stages)
        expected = _fewest_by_exhaustion(problem, m, schedule, stages)
        if expected == math.inf:
            assert lean is None
            continue
        assert lean is not None and lean.devices == expected
        cand = candidate(problem, list(lean.bounds), list(lean.replicas), m, schedule, "append-first", "lean")
        assert cand is not None and evaluate(problem, cand).fits
        assert stages is None or len(lean.replicas) == stages


def test_tightest_layer_is_the_one_that_needs_most_with_one_sample() -> None:
    problem = _problem(3, [5 * GB, 9 * GB, 8 * GB], [4 * GB, 1 * GB, 3 * GB], "1x8xV100-16GB")
    worst = tightest_layer(problem)
    # node0: 9 GB, node1: 10 GB, node2: 11 GB with one sample in flight.
    assert (worst.name, worst.static_bytes, worst.activation_bytes) == ("node2", 8 * GB, 3 * GB)


# ------------------------------------------------------------------------------------- the advice


def _memory_bound_problem(cluster: str) -> Problem:
    """24 layers of 4 GB static state and 0.25 GB of activations per sample on 16 GB devices:
    96 GB of static state alone needs 6 devices, and activations decide how many more."""
    return _problem(24, 4 * GB, 0.25 * GB, cluster)


#: The DP alone: the CP-SAT model (which `auto` adds on small clusters) takes seconds per search.
DP = Request(method="dp")


def _advice(problem: Problem, req: Request = DP) -> MemoryAdvice:
    with pytest.raises(PlanError) as caught:
        search(problem, req)
    advice = memory_advice(problem, req)
    assert advice.text in str(caught.value), "the error carries the same advice"
    return advice


def test_advised_cluster_plans_and_the_next_smaller_does_not() -> None:
    problem = _memory_bound_problem("1x4xV100-16GB")
    advice = _advice(problem)
    assert advice.cluster is not None and advice.least_devices is not None
    nodes, per, kind = advice.cluster.split("x")
    assert (int(per), kind) == (4, "V100-16GB")
    assert f"--cluster {advice.cluster}" in advice.text
    assert _plans(_on(problem, advice.cluster), Request(method="dp", microbatches=advice.microbatches))
    smaller = f"{int(nodes) - 1}x4xV100-16GB"
    assert not _plans(_on(problem, smaller), DP)
    assert not any(_plans(_on(problem, smaller), Request(method="dp", microbatches=m)) for m in _divisors(64))
    # The bound it states is what the memory model allows: no candidate on fewer devices fits.
    assert advice.least_devices == min(
        lean.devices for m in _divisors(64) if (lean := leanest_plan(problem, m, "1f1b", recompute=True)) is not None
    )
    # Transfers here are 1 MB a microbatch: the planner fills the first node count the bound allows.
    assert int(nodes) == -(-advice.least_devices // 4)


def test_every_cluster_that_does_not_fit_gets_the_same_advice() -> None:
    first = _advice(_memory_bound_problem("1x2xV100-16GB"))
    assert first.cluster is not None
    nodes = int(first.cluster.split("x")[0])
    assert nodes > 3, "the check below needs several clusters that do not fit"
    for k in range(2, nodes):
        again = _advice(_memory_bound_problem(f"{k}x2xV100-16GB"))
        assert (again.cluster, again.microbatches, again.text) == (first.cluster, first.microbatches, first.text)
    assert _plans(_memory_bound_problem(f"{nodes + 1}x2xV100-16GB"), DP)


def test_forced_microbatches_get_the_fewest_that_fit_on_this_cluster() -> None:
    # With 16 devices the model fits, but not with 2 microbatches of 32 samples.
    problem = _memory_bound_problem("2x8xV100-16GB")
    assert _plans(problem, DP)
    advice = _advice(problem, Request(method="dp", microbatches=2))
    assert advice.cluster == "2x8xV100-16GB" and advice.microbatches is not None
    assert f"It fits on 2x8xV100-16GB with --microbatches {advice.microbatches}" in advice.text
    assert _plans(problem, Request(method="dp", microbatches=advice.microbatches))
    assert not any(
        _plans(problem, Request(method="dp", microbatches=m)) for m in _divisors(64) if m < advice.microbatches
    )


@pytest.mark.slow
def test_planner_finds_the_lean_plan_the_memory_model_allows() -> None:
    # A 70B-like model: 80 layers of 13.7 GB of static state and 2.84 GB of activations per sample
    # on 80 GB devices. On a cluster with just as many devices as the memory model needs, the DP's
    # coarse replica counts (powers of two beyond 64 devices) find nothing; the planner still plans
    # (the memory-first candidate), so the advice never names a cluster the planner cannot fill.
    problem = _problem(80, 13.7 * GB, 2.84 * GB, "1x8xH100")
    need = min(lean.devices for m in _divisors(64) if (lean := leanest_plan(problem, m, "1f1b")) is not None)
    nodes = -(-need // 8)
    assert nodes * 8 > 64
    plain = dataclasses.replace(DP, recompute="none")  # recomputation would fit it on fewer
    assert _plans(_on(problem, f"{nodes}x8xH100"), plain)
    assert (nodes - 1) * 8 < need and not _plans(_on(problem, f"{nodes - 1}x8xH100"), plain)


def test_a_layer_too_big_for_any_cluster_is_named() -> None:
    # node1 holds 10 GB of static state and 7 GB of activations for one sample: more than 16 GB.
    problem = _problem(3, [4 * GB, 10 * GB, 4 * GB], [1 * GB, 7 * GB, 1 * GB], "2x8xV100-16GB")
    advice = _advice(problem)
    assert advice.cluster is None and advice.least_devices is None
    assert "layer node1 alone needs 10.0 GB" in advice.text and "7.0 GB of activations" in advice.text
    assert not _plans(_on(problem, "64x8xV100-16GB"), DP)


def test_forced_stages_that_never_fit_are_named() -> None:
    problem = _memory_bound_problem("2x8xV100-16GB")
    advice = _advice(problem, Request(method="dp", stages=2))
    assert advice.cluster is None and "No plan of 2 stages fits" in advice.text


def test_none_up_to_the_bound_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from dapple_ir.planner import memory_advice as memory_advice_module

    monkeypatch.setattr(memory_advice_module, "ADVICE_MAX_DEVICES", 8)
    # Without recomputation: with it, 2x4 would fit.
    advice = _advice(_memory_bound_problem("1x4xV100-16GB"), dataclasses.replace(DP, recompute="none"))
    assert advice.cluster is None and "No cluster of 4-device nodes up to 2x4xV100-16GB fits it" in advice.text


# ---------------------------------------------------------------------------------- end to end


def _profile(path: Path, layers: int, params: float, activation: float) -> Path:
    return write_chain_profile(path, [(1.0, activation, params)] * layers)


@pytest.mark.slow
def test_following_the_advice_compiles(tmp_path: Path) -> None:
    # 16 layers of 1 GB of parameters (4 GB with Adam) and 8 GB of activations at the profile's 64
    # samples: the full pipeline (simulated peaks, `verify`) accepts the advised cluster.
    graph = _profile(tmp_path / "graph.txt", 16, 1e9, 8e9)
    spec = f"profile:{graph}"
    with pytest.raises(DappleError, match="no plan fits in memory") as caught:
        compile_plan(spec, cluster="1x4xV100-16GB", global_batch=64)
    message = str(caught.value)
    assert "--cluster " in message
    flags = message.split("--cluster ", 1)[1].split(")", 1)[0].split()
    cluster = flags[0]
    microbatches = int(flags[2]) if len(flags) > 2 else None
    result = compile_plan(spec, cluster=cluster, global_batch=64, microbatches=microbatches, out_dir=tmp_path / "p")
    assert result.module.programs and (tmp_path / "p" / "plan.json").exists()
    nodes = int(cluster.split("x")[0])
    with pytest.raises(DappleError, match="no plan fits in memory"):
        compile_plan(spec, cluster=f"{nodes - 1}x4xV100-16GB", global_batch=64)


def test_lean_plan_counting_transfers_fits_once_lowered(tmp_path: Path) -> None:
    # 8 layers of 4 GB of static state and 1 GB of activations per sample (64 GB at the profile's
    # 64), each layer's output as large as its activations: a stage that keeps 12 microbatches of
    # its own activations (what the cost model counts) also keeps the 12 inputs it received.
    graph = _profile(tmp_path / "graph.txt", 8, 1e9, 64e9)
    spec = f"profile:{graph}"
    result = compile_plan(spec, cluster="1x64xV100-16GB", global_batch=64, microbatches=64, planner="dp")
    from dapple_ir.planner.cost_model import problem_from_module

    problem = problem_from_module(result.module, parse_shorthand("1x64xV100-16GB"), 64)
    lean = leanest_plan(problem, 64, "1f1b", transfers=True)
    bare = leanest_plan(problem, 64, "1f1b")
    assert lean is not None and bare is not None and lean.devices > bare.devices
    cluster = f"1x{lean.devices}xV100-16GB"
    planned = compile_plan(spec, cluster=cluster, global_batch=64, microbatches=64, planner="dp")
    peaks = planned.plan["peak_bytes"].values()
    assert max(peaks) <= 16 * GB
