"""A microbatch's cost has a fixed part: every op call pays the device's `op_overhead` (launch, and the
floor of a kernel too small to fill the device) whatever its size, and only the rest scales.

The oracles: the affine curve in closed form; the planner's estimate and the simulator against a sum
over the ops computed here; the plan a profile gets once one-sample microbatches cost what they do;
and a calibration that recovers a fixed cost planted in synthetic timings.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dapple_ir.cli import main
from dapple_ir.cluster.roofline import fixed_s, rescaled_s
from dapple_ir.cluster.spec import PRESETS, DeviceKind
from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.commands.calibrate import fit_fixed_s
from dapple_ir.errors import DappleError
from dapple_ir.frontend.profile_import import import_profile
from dapple_ir.ir import InstrKind, Module
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.passes.plan import lower_and_simulate, lowered_trial
from dapple_ir.planner.cost_model import Candidate, Problem, StageChoice, evaluate, problem_from_module
from dapple_ir.registry import PassContext
from dapple_ir.sim.simulator import simulate
from tests.paths import PROFILES
from tests.pipeline_fixtures import write_chain_profile

KIND = DeviceKind("toy", 1e9, {"f32": 1e12}, 1e11, op_overhead=1e-4)
VGG19 = PROFILES / "dapple-vgg-19-pbs-32.txt"


def test_the_cost_curve_is_affine_with_a_fixed_part_per_call() -> None:
    t = 1e-3  # seconds at 8 samples
    assert fixed_s(t, KIND) == 1e-4 and fixed_s(5e-5, KIND) == 5e-5 and fixed_s(0.0, KIND) == 0.0
    assert rescaled_s(t, 8, 2, KIND) == pytest.approx(1e-4 + 9e-4 * 2 / 8)
    assert rescaled_s(t, 8, 32, KIND) == pytest.approx(1e-4 + 9e-4 * 4)
    # Moving through another size changes nothing: one line through (8, t).
    assert rescaled_s(rescaled_s(t, 8, 3, KIND), 3, 5, KIND) == pytest.approx(rescaled_s(t, 8, 5, KIND))
    # Efficiency (variable part over the whole) is one half where the variable part equals the fixed:
    # 9e-4 / 8 per sample, so at 8 / 9 of a sample.
    half = 8 * 1e-4 / 9e-4
    assert rescaled_s(t, 8, half, KIND) == pytest.approx(2 * 1e-4)
    # A call cheaper than the fixed part is all fixed; without a fixed part, the old linear rule.
    assert rescaled_s(5e-5, 8, 1, KIND) == 5e-5
    assert rescaled_s(t, 8, 2, DeviceKind("free", 1e9, {"f32": 1e12}, 1e11)) == pytest.approx(t / 4)


def test_every_gpu_preset_has_a_fixed_part() -> None:
    for name in ("V100-16GB", "V100-32GB", "A100-40GB", "A100-80GB", "H100", "H200", "cpu"):
        assert 1e-6 <= PRESETS[name].op_overhead <= 1e-4, name


def _chain(tmp_path: Path, profile_batch: int = 8) -> Module:
    """A four-op chain profile at `profile_batch` samples: forward 1, 2, 0.01 and 3 ms, backward twice."""
    layers = [(f, 1000.0, 1000.0) for f in (1.0, 2.0, 0.01, 3.0)]
    path = write_chain_profile(tmp_path / f"chain-pbs-{profile_batch}.txt", layers)
    module = import_profile(str(path))
    PassManager(build_pipeline("coarsen")).run(module)
    return module


@pytest.mark.parametrize("microbatches", [1, 4, 64])
def test_estimate_and_simulator_both_keep_the_fixed_part(tmp_path: Path, microbatches: int) -> None:
    module = _chain(tmp_path)
    cluster = resolve_cluster("1xV100-16GB")
    call = cluster.device(0).op_overhead
    problem = problem_from_module(module, cluster, 64)
    cand = Candidate((StageChoice(0, problem.layers, (0,)),), microbatches)
    compute = _compute_by_hand(module, call, 64, microbatches)
    # Both price the optimizer step after it (`pricing.host.optimizer_step_s`): Adam streams 7 bytes per parameter byte.
    step = 7 * problem.grads_of(0, problem.layers) / cluster.device(0).mem_bandwidth
    assert step > 0
    assert evaluate(problem, cand).iteration_s == pytest.approx(compute + step, rel=1e-9)
    simulated, _peak = lower_and_simulate(module, problem, cand)
    assert simulated == pytest.approx(compute + step, rel=1e-9)
    # Against the linear rule (8 profile batches' worth of time): the fixed part is paid M times
    # rather than 8, so 64 one-sample microbatches cost 56 more of it, one microbatch of 64 7 fewer.
    linear = sum((op.attrs.fwd_s or 0.0) + (op.attrs.bwd_s or 0.0) for op in module.ops) * 64 / 8
    calls = [t for op in module.ops for t in (op.attrs.fwd_s or 0.0, op.attrs.bwd_s or 0.0) if t > 0]
    assert len(calls) == 8
    fixed_sum = sum(min(t, call) for t in calls)
    assert compute - linear == pytest.approx((microbatches - 8) * fixed_sum, rel=1e-9, abs=1e-15)


def _compute_by_hand(module: Module, call: float, global_batch: int, microbatches: int) -> float:
    """The chain's compute over a step of M microbatches, by hand: per op and direction, the fixed part `call` once
    per microbatch plus the rest scaled from the profile's 8 samples."""
    b = global_batch // microbatches
    per_microbatch = 0.0
    for op in module.ops:
        for t in (op.attrs.fwd_s or 0.0, op.attrs.bwd_s or 0.0):
            fixed = min(t, call)
            per_microbatch += fixed + (t - fixed) * b / 8
    return microbatches * per_microbatch


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_ranks_sharing_cores_cannot_beat_the_cores_doing_all_the_work(tmp_path: Path, schedule: str) -> None:
    """Four stages on one node whose 4 ranks share c cores (`cores_per_node`): the estimate is never below the whole
    step's compute (by hand) over c, the core floor, and where that floor is above the pipeline's time it is the
    estimate; with cores enough (0, or 4) nothing changes. The simulator, which shares the cores as the ranks
    run, never ends below the floor either."""
    module = _chain(tmp_path)
    plain = resolve_cluster("4xV100-16GB")
    call = plain.device(0).op_overhead
    stages = tuple(StageChoice(k, k + 1, (k,)) for k in range(4))
    bare = problem_from_module(module, plain, 64)
    for m in (1, 4, 16):
        cand = Candidate(stages, m, schedule=schedule)
        unshared = evaluate(bare, cand)
        compute = _compute_by_hand(module, call, 64, m)
        for cores in (1, 2):
            problem = problem_from_module(module, dataclasses.replace(plain, cores_per_node=cores), 64)
            estimate = evaluate(problem, cand)
            assert estimate.cores_s == pytest.approx(compute / cores, rel=1e-9)
            assert estimate.iteration_s == pytest.approx(max(unshared.iteration_s, compute / cores), rel=1e-9)
            simulated, _peak = lower_and_simulate(module, problem, cand)
            assert simulated >= compute / cores * (1 - 1e-9)
        for cores in (0, 4):
            problem = problem_from_module(module, dataclasses.replace(plain, cores_per_node=cores), 64)
            assert evaluate(problem, cand) == unshared


def _split_by_the_schedule(module: Module, problem: Problem, cand: Candidate) -> list[bool]:
    """Per stage of `cand`, whether its lowered program runs input passes (zb-h1 splits its backward)."""
    trial, _notes = lowered_trial(module, problem, cand)
    return [any(i.kind is InstrKind.BACKWARD_INPUT for i in p.instrs) for p in trial.programs]


def test_the_estimate_charges_a_split_backward_its_weight_passes(tmp_path: Path) -> None:
    """Under zb-h1 the cost model adds `split_backward_overhead` c per weight op and `split_backward_per_byte` p per
    byte of their parameters to the backward of every stage that splits it and hands a gradient back (not the first:
    `Problem.split_s`). Reference: the same estimate with c = p = 0 and each such layer's backward c + p x its
    parameter bytes longer in its fixed part (which does not scale with the microbatch), the split stages read from
    the lowered programs (at M=1 the second stage's split would hold more than 1f1b's fullest rank: the schedule runs
    its backward whole). Other schedules pay nothing."""
    module = _chain(tmp_path)
    plain = resolve_cluster("2xV100-16GB")
    c, p = 1e-3, 1e-6
    priced = dataclasses.replace(
        plain,
        node_kinds=tuple(
            dataclasses.replace(k, split_backward_overhead=c, split_backward_per_byte=p) for k in plain.node_kinds
        ),
    )
    problem, bare = problem_from_module(module, priced, 64), problem_from_module(module, plain, 64)
    assert problem.weight_ops == [1, 1, 1, 1]  # each imported layer has parameter bytes (1000)
    assert problem.weight_op_bytes == [1000.0] * 4
    stages = (StageChoice(0, 2, (0,)), StageChoice(2, 4, (1,)))
    seen = set()
    for m in (1, 4, 16):
        zb = Candidate(stages, m, schedule="zb-h1")
        split = _split_by_the_schedule(module, problem, zb)[1]
        seen.add(split)
        extra = [0.0, 0.0, *[(c + 1000 * p) * split] * 2]  # the second stage's two layers, where it splits
        by_hand = dataclasses.replace(
            bare,
            bwd_s=[t + x for t, x in zip(bare.bwd_s, extra, strict=True)],
            bwd_fixed_s=[t + x for t, x in zip(bare.bwd_fixed_s, extra, strict=True)],
        )
        assert evaluate(problem, zb).iteration_s == pytest.approx(evaluate(by_hand, zb).iteration_s, rel=1e-12)
        assert (evaluate(problem, zb).iteration_s > evaluate(bare, zb).iteration_s) == split
        for schedule in ("1f1b", "gpipe"):
            cand = Candidate(stages, m, schedule=schedule)
            assert evaluate(problem, cand).iteration_s == pytest.approx(evaluate(bare, cand).iteration_s, rel=1e-12)
    assert seen == {False, True}


def test_the_estimate_charges_the_hosts_work_per_instruction_and_message(tmp_path: Path) -> None:
    """Every stage pays `instruction_overhead` h per compute instruction and `message_overhead` q per send or
    receive (one each way per neighbouring stage) in every microbatch: on 2 stages each stage's forward and backward
    are h + q longer, and under zb-h1 the backward of each stage that splits it is two instructions (the first
    stage's input pass is empty but runs), 2h + q. Reference: the same estimate with h = q = 0 and those seconds
    added by hand to the fixed part of each stage's first layer, the split stages read from the lowered programs."""
    module = _chain(tmp_path)
    plain = resolve_cluster("2xV100-16GB")
    h, q = 1e-3, 3e-4
    priced = dataclasses.replace(
        plain,
        node_kinds=tuple(dataclasses.replace(k, instruction_overhead=h, message_overhead=q) for k in plain.node_kinds),
    )
    problem, bare = problem_from_module(module, priced, 64), problem_from_module(module, plain, 64)
    stages = (StageChoice(0, 2, (0,)), StageChoice(2, 4, (1,)))
    for schedule in ("1f1b", "gpipe", "zb-h1"):
        for m in (1, 4, 16):
            cand = Candidate(stages, m, schedule=schedule)
            first, second = (1 + split for split in _split_by_the_schedule(module, problem, cand))
            fwd_extra = [h + q, 0.0, h + q, 0.0]
            bwd_extra = [first * h + q, 0.0, second * h + q, 0.0]
            by_hand = dataclasses.replace(
                bare,
                fwd_s=[t + x for t, x in zip(bare.fwd_s, fwd_extra, strict=True)],
                fwd_fixed_s=[t + x for t, x in zip(bare.fwd_fixed_s, fwd_extra, strict=True)],
                bwd_s=[t + x for t, x in zip(bare.bwd_s, bwd_extra, strict=True)],
                bwd_fixed_s=[t + x for t, x in zip(bare.bwd_fixed_s, bwd_extra, strict=True)],
            )
            assert evaluate(problem, cand).iteration_s == pytest.approx(evaluate(by_hand, cand).iteration_s, rel=1e-12)
            assert evaluate(problem, cand).iteration_s > evaluate(bare, cand).iteration_s


def test_the_plan_carries_costs_at_its_microbatch_so_simulate_agrees(tmp_path: Path) -> None:
    module = _chain(tmp_path)
    module.attrs.global_batch = 64
    ctx = PassContext(cluster="2xV100-16GB")
    PassManager(build_pipeline("plan{microbatches=16},schedule,lower-comm,insert-frees")).run(module, ctx)
    assert module.attrs.cost_batch == module.attrs.microbatch_size == 4
    first = module.ops[0].attrs.fwd_s
    assert first == pytest.approx(rescaled_s(1e-3, 8, 4, PRESETS["V100-16GB"]))
    assert module.attrs.predicted_iteration_s == pytest.approx(simulate(module).iteration_s, rel=1e-9)


def test_profile_rescale_keeps_the_fixed_part_where_the_device_is_known(tmp_path: Path) -> None:
    known = _chain(tmp_path)
    ctx = PassContext(cluster="1xV100-16GB")
    PassManager(build_pipeline("annotate-cost{microbatch=2}")).run(known, ctx)
    call = PRESETS["V100-16GB"].op_overhead
    assert known.ops[0].attrs.fwd_s == pytest.approx(call + (1e-3 - call) * 2 / 8)
    assert known.ops[2].attrs.fwd_s == pytest.approx(1e-5)  # cheaper than a call: all fixed
    assert known.attrs.cost_batch == 2
    unknown = _chain(tmp_path)
    PassManager(build_pipeline("annotate-cost{microbatch=2}")).run(unknown, PassContext())
    assert unknown.ops[0].attrs.fwd_s == pytest.approx(1e-3 * 2 / 8)  # no device: the linear rule


def test_vgg19_no_longer_plans_one_sample_microbatches() -> None:
    # DAPPLE's VGG-19 profile on its 2x8 V100 servers, global batch 2048: priced linearly, 2048
    # microbatches of one sample looked free (each stage's bubble shrinks with the microbatch).
    module = import_profile(str(VGG19))
    module.attrs.global_batch = 2048
    ctx = PassContext(cluster="2x8xV100-16GB")
    PassManager(build_pipeline("coarsen")).run(module, ctx)
    before = problem_from_module(module, resolve_cluster("2x8xV100-16GB"), 2048)
    PassManager(build_pipeline("plan")).run(module, ctx)
    chosen_b = module.attrs.microbatch_size
    assert chosen_b is not None and chosen_b > 1
    chosen_s = module.attrs.predicted_iteration_s
    assert chosen_s is not None
    # The same stages with one-sample microbatches, simulated with their fixed parts, are slower.
    layer_of = {op: k for k, layer in enumerate(module.layers) for op in layer.ops}
    spans = [sorted(layer_of[op] for op in stage.ops) for stage in module.stages]
    stages = tuple(
        StageChoice(span[0], span[-1] + 1, tuple(stage.attrs.devices or ()))
        for span, stage in zip(spans, module.stages, strict=True)
    )
    fresh = import_profile(str(VGG19))
    PassManager(build_pipeline("coarsen")).run(fresh, PassContext(cluster="2x8xV100-16GB"))
    one_sample = Candidate(stages, 2048, module.attrs.schedule or "1f1b")
    slower, _peak = lower_and_simulate(fresh, before, one_sample)
    assert slower > chosen_s


def _profile_json(path: Path, batch: int, fixed: float, per_sample: dict[str, float]) -> None:
    ops = {
        name: {"fwd_s": fixed + k * batch, "bwd_s": fixed + 2 * k * batch, "act_bytes": 1.0}
        for name, k in per_sample.items()
    }
    ops["x"] = {"fwd_s": 0.0, "bwd_s": 0.0}  # an input: no call to count
    path.write_text(json.dumps({"model": "toy", "device": "toy", "microbatch": batch, "ops": ops}))


def test_calibration_recovers_a_planted_fixed_cost(tmp_path: Path) -> None:
    per_sample = {"a": 1e-5, "b": 3e-4, "c": 2e-6}
    paths = []
    for batch in (2, 8, 32):
        path = tmp_path / f"profile-{batch}.json"
        _profile_json(path, batch, 4e-5, per_sample)
        paths.append(str(path))
    assert fit_fixed_s(paths) == pytest.approx(4e-5, rel=1e-9)
    assert fit_fixed_s(paths[:2]) == pytest.approx(4e-5, rel=1e-9)
    # Through the command: the cluster it writes carries the fitted fixed part.
    out = tmp_path / "cluster.toml"
    assert main(["calibrate", "--devices", "1", "--fit", *paths, "-o", str(out)]) == 0
    assert resolve_cluster(str(out)).device(0).op_overhead == pytest.approx(4e-5, rel=1e-6)


def test_the_fixed_cost_is_fitted_to_the_whole_step_as_the_efficiency_is(tmp_path: Path) -> None:
    """A profile that timed its whole step (`step_s`) has its op times scaled to it before the line is fitted, as
    `fit_efficiency` scales them: each profile's step half its ops' sum halves its points, and so the fixed part
    (the planted 4e-5 s becomes 2e-5 s); a profile without `step_s` stays as timed."""
    per_sample = {"a": 1e-5, "b": 3e-4}
    paths = []
    for batch in (2, 8, 32):
        path = tmp_path / f"profile-{batch}.json"
        _profile_json(path, batch, 4e-5, per_sample)
        profile = json.loads(path.read_text())
        profile["step_s"] = sum(e["fwd_s"] + e["bwd_s"] for e in profile["ops"].values()) / 2
        path.write_text(json.dumps(profile))
        paths.append(str(path))
    assert fit_fixed_s(paths) == pytest.approx(2e-5, rel=1e-9)


def test_calibration_needs_two_microbatch_sizes(tmp_path: Path) -> None:
    one, same = tmp_path / "one.json", tmp_path / "same.json"
    _profile_json(one, 4, 1e-5, {"a": 1e-5})
    _profile_json(same, 4, 1e-5, {"a": 1e-5})
    with pytest.raises(DappleError, match="two or more microbatch sizes"):
        fit_fixed_s([str(one), str(same)])


#: A Linear(1024, 1024) captured at 8 samples, on one V100: reading its 4 MB of weights takes longer than its
#: FLOPs at 8 samples, its FLOPs longer than its bytes at 256 (the golden `annotate_cost/roofline` case).
_LINEAR = """module @mlp attributes {batch = 8, cluster = "1x1xV100-16GB"} {
  param @fc.weight : f32[1024,1024]
  param @fc.bias : f32[1024]
  %x = input : f32[8,1024] {act_bytes = 32768.0}
  %fc = call_module @fc(%x) : f32[8,1024] {fwd_flops = 16777216.0, bwd_flops = 33554432.0, mem_bytes = 4263936.0, \
op_class = "matmul", act_bytes = 0.0, params = [@fc.weight, @fc.bias]}
  %loss = call_method @sum(%fc) : f32[] {fwd_flops = 0.0, bwd_flops = 0.0, mem_bytes = 32772.0, \
op_class = "elementwise", act_bytes = 0.0}
  %output = output(%loss) : f32[]
}
"""


def _linear_by_hand(batch: int) -> tuple[float, float]:
    """The Linear's roofline at `batch` samples, by hand: V100 f32 15.7 TFLOP/s, 900 GB/s, matmul at 0.6."""
    peak, bandwidth, call = 15.7e12, 900e9, PRESETS["V100-16GB"].op_overhead
    flops = 2 * batch * 1024 * 1024
    moved = (1024 * 1024 + 1024) * 4 + 2 * batch * 1024 * 4
    return (
        max(flops / peak, moved / bandwidth) / 0.6 + call,
        max(2 * flops / peak, 2 * moved / bandwidth) / 0.6 + call,
    )


def test_an_op_the_roofline_priced_is_priced_again_at_each_microbatch() -> None:
    """Memory-bound at its 8 samples, compute-bound at 256: no straight line through its time at 8 finds its
    time at 256 (the weights' bytes do not grow with the batch), so the planner and `plan` price it again."""
    from dapple_ir.ir.parser import parse_module

    at8, at256 = _linear_by_hand(8), _linear_by_hand(256)
    call = PRESETS["V100-16GB"].op_overhead
    assert 8 * 1024 * 1024 * 2 / 15.7e12 < (1024 * 1024 + 1024) * 4 / 900e9  # memory-bound at 8
    assert rescaled_s(at8[0], 8, 256, PRESETS["V100-16GB"]) > 3 * at256[0]  # the affine move overshoots 3x
    module = parse_module(_LINEAR)
    module.attrs.global_batch = 256
    ctx = PassContext(cluster="1x1xV100-16GB")
    PassManager(build_pipeline("annotate-cost,coarsen")).run(module, ctx)
    fc = next(op for op in module.ops if op.name == "fc")
    assert (fc.attrs.fwd_s, fc.attrs.bwd_s) == pytest.approx(at8, rel=1e-12)
    problem = problem_from_module(module, resolve_cluster("1x1xV100-16GB"), 256)
    sum_op = next(op for op in module.ops if op.name == "loss")
    for rows in (8, 64, 256):
        fwd, bwd = problem.times_at(rows)
        linear = _linear_by_hand(rows)
        assert fwd[-1] == pytest.approx(
            linear[0] + rescaled_s(sum_op.attrs.fwd_s or 0.0, 8, rows, PRESETS["V100-16GB"])
        )
        assert bwd[-1] == pytest.approx(
            linear[1] + rescaled_s(sum_op.attrs.bwd_s or 0.0, 8, rows, PRESETS["V100-16GB"])
        )
    # The plan writes the op's time at its microbatch, and the simulator prices that.
    PassManager(build_pipeline("plan{microbatches=1},schedule,lower-comm,insert-frees")).run(module, ctx)
    assert module.attrs.cost_batch == 256
    assert (fc.attrs.fwd_s, fc.attrs.bwd_s) == pytest.approx(at256, rel=1e-12)
    assert fc.attrs.fwd_s is not None and fc.attrs.fwd_s - call < (at8[0] - call) * 32 / 3
    # Priced with efficiencies of its own (annotate-cost's option), an op is not the cluster's roofline: affine.
    other = parse_module(_LINEAR)
    PassManager(build_pipeline("annotate-cost{efficiency=0.3},coarsen")).run(other, ctx)
    fc_other = next(op for op in other.ops if op.name == "fc")
    kept = problem_from_module(other, resolve_cluster("1x1xV100-16GB"), 256).times_at(256)[0][1]
    assert kept == pytest.approx(rescaled_s(fc_other.attrs.fwd_s or 0.0, 8, 256, PRESETS["V100-16GB"]))
