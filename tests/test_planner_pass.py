"""The plan pass honours every forced choice and writes what the lowering passes need."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dapple_ir import schedules
from dapple_ir.cli import main
from dapple_ir.errors import PassError, PassOptionError
from dapple_ir.frontend.profile_import import import_profile
from dapple_ir.ir import InstrKind, Module
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.registry import PassContext
from tests.paths import PROFILES
from tests.pipeline_fixtures import reverse_gpipe_registered

VGG19 = PROFILES / "dapple-vgg-19-pbs-32.txt"


def _planned(options: str, cluster: str = "2x8xV100-16GB", global_batch: int = 256) -> tuple[Module, PassContext]:
    module = import_profile(str(VGG19))
    module.attrs.global_batch = global_batch
    ctx = PassContext(cluster=cluster)
    PassManager(build_pipeline(f"coarsen,plan{{{options}}}")).run(module, ctx)
    return module, ctx


def test_forced_choices_are_kept() -> None:
    module, ctx = _planned("method=dp,stages=3,microbatches=32,schedule=gpipe,policy=fresh-first,simulate=false")
    assert len(module.stages) == 3
    attrs = module.attrs
    assert (attrs.microbatches, attrs.microbatch_size, attrs.global_batch) == (32, 8, 256)
    assert attrs.schedule == "gpipe" and attrs.cluster == "2x8xV100-16GB"
    # fresh-first: a stage that follows a partly used node starts on the next node.
    used: list[int] = []
    for stage in module.stages:
        devices = list(stage.attrs.devices or ())
        assert len(devices) == stage.replicas
        if used and used[-1] % 8 != 7 and devices[0] != used[-1] + 1:
            assert devices[0] % 8 == 0
        used += devices
    assert len(set(used)) == len(used)
    assert any("CHOSEN" in line for line in ctx.reports["plan"])


def test_every_op_lands_in_one_stage_in_pipeline_order() -> None:
    module, _ = _planned("method=dp,simulate=false")
    position = {op: i for i, op in enumerate(module.ops)}
    flat = [op for stage in module.stages for op in stage.ops]
    assert sorted(flat, key=position.__getitem__) == module.ops
    assert [position[op] for op in flat] == sorted(position[op] for op in flat)
    assert module.attrs.predicted_iteration_s is not None and module.attrs.predicted_iteration_s > 0


def test_plan_needs_a_cluster_and_a_global_batch() -> None:
    module = import_profile(str(VGG19))
    with pytest.raises(PassError, match="no cluster"):
        PassManager(build_pipeline("coarsen,plan")).run(module, PassContext())
    with pytest.raises(PassError, match="no global batch"):
        PassManager(build_pipeline("coarsen,plan")).run(import_profile(str(VGG19)), PassContext(cluster="4xV100-16GB"))


def test_bad_option_values() -> None:
    with pytest.raises(PassError, match="method must be one of"):
        _planned("method=greedy")
    with pytest.raises(PassOptionError, match="option 'stages' of pass 'plan' must be int or auto, not 'many'"):
        _planned("stages=many")
    with pytest.raises(PassError, match="stages must be auto or a positive integer, not 0"):
        _planned("stages=0")
    with pytest.raises(PassError, match="schedule must be auto or one of gpipe, 1f1b, zb-h1, interleaved"):
        _planned("schedule=pipedream")


def test_a_registered_schedule_is_planned_with_and_simulated() -> None:
    # The cost model knows no formula for it (it estimates it like 1f1b); the simulator lowers the real order.
    with reverse_gpipe_registered("test-reverse-gpipe"):
        module, ctx = _planned("method=dp,schedule=test-reverse-gpipe")
        PassManager(build_pipeline("schedule,lower-comm,insert-frees,verify")).run(module, ctx)
    assert module.attrs.schedule == "test-reverse-gpipe"
    chosen = next(line for line in ctx.reports["plan"] if line.endswith("CHOSEN"))
    # model ms, sim ms, peak GB, busiest link and its share: the chosen plan was simulated under the
    # registered schedule.
    assert re.search(r"test-reverse-gpipe +[0-9.]+ +[0-9.]+ +[0-9.]+ +\S.* +(-|[0-9]+) +CHOSEN$", chosen), chosen
    backwards = [i.mb for i in module.programs[0].instrs if i.kind is InstrKind.BACKWARD]
    assert backwards == sorted(backwards, reverse=True)


def test_compile_schedule_accepts_exactly_the_registered_names(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plugin = tmp_path / "my_schedule.py"
    plugin.write_text(
        "from dapple_ir.schedules import one_f_one_b, register_schedule\n"
        "register_schedule('test-plugin-1f1b')(one_f_one_b)\n"
    )
    common = [f"profile:{VGG19}", "--cluster", "2x8xV100-16GB", "--global-batch", "256", "--profile-batch", "32"]
    assert main(["compile", *common, "--schedule", "test-plugin-1f1b", "-o", str(tmp_path / "no")]) == 2
    assert "--schedule must be one of the registered schedules (gpipe, 1f1b, zb-h1, interleaved)" in (
        capsys.readouterr().err
    )
    try:
        args = ["--pass-plugin", str(plugin), "--schedule", "test-plugin-1f1b", "--planner", "dp"]
        assert main(["compile", *common, *args, "-o", str(tmp_path / "plan")]) == 0
    finally:
        del schedules.SCHEDULES["test-plugin-1f1b"]
    assert 'schedule = "test-plugin-1f1b"' in (tmp_path / "plan" / "plan.dapple").read_text()
