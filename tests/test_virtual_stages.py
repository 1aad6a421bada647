"""Virtual stages as a planner choice: `plan{virtual=V}`, `--virtual`, `--schedule interleaved` choosing V.

The planner makes S = P x V stages with stage k on device group k % P (Megatron's interleaved
placement). The oracles: the closed form of the interleaved pipeline on free links, the simulator
(which lowers the real interleaved order) for the estimate and for `auto`'s choice, and single-device
training for the plan `dapple compile --schedule interleaved` writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dapple_ir.api import compile as compile_plan
from dapple_ir.backends.torch.launch import run
from dapple_ir.backends.torch.reference import train_reference
from dapple_ir.backends.torch.tolerances import ATOL, RTOL
from dapple_ir.cli import main
from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.errors import DappleError, PassError
from dapple_ir.frontend.profile_import import import_profile
from dapple_ir.ir import Module, OpKind
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.passes.plan import lower_and_simulate
from dapple_ir.planner.baselines import interleaved_variant, time_balanced_partition
from dapple_ir.planner.cost_model import Problem, candidate, evaluate, problem_from_module
from dapple_ir.registry import PassContext
from tests.paths import PROFILES
from tests.test_planner_exact import _ideal
from tests.test_runtime import MLP

BERT48 = PROFILES / "dapple-bert-48-pbs-2.txt"
GNMT16 = PROFILES / "dapple-gnmt-16-pbs-64.txt"


def _planned(
    path: Path, options: str, cluster: str, global_batch: int, lower: bool = False
) -> tuple[Module, PassContext]:
    module = import_profile(str(path))
    module.attrs.global_batch = global_batch
    ctx = PassContext(cluster=cluster)
    tail = ",schedule,lower-comm,insert-frees,verify" if lower else ""
    PassManager(build_pipeline(f"coarsen,plan{{{options}}}{tail}")).run(module, ctx)
    return module, ctx


def _coarsened(path: Path, cluster: str, global_batch: int) -> tuple[Module, Problem]:
    module = import_profile(str(path))
    module.attrs.global_batch = global_batch
    PassManager(build_pipeline("coarsen")).run(module, PassContext(cluster=cluster))
    return module, problem_from_module(module, resolve_cluster(cluster), global_batch)


def _assert_megatron_placement(module: Module, groups: int) -> None:
    stages = module.stages
    assert len(stages) % groups == 0 and len(stages) > groups
    leads = [set(s.attrs.devices or ()) for s in stages[:groups]]
    assert all(leads) and sum(len(d) for d in leads) == len(set().union(*leads))  # groups are disjoint
    for k, stage in enumerate(stages):
        assert stage.attrs.devices == stages[k % groups].attrs.devices
    position = {op: i for i, op in enumerate(module.ops)}
    flat = [position[op] for stage in stages for op in stage.ops]
    assert sorted(flat) == sorted(position.values())  # every op in exactly one stage
    # Stages in pipeline order (inputs such as the targets sit where they are used).
    firsts = [min(position[op] for op in stage.ops if op.kind is not OpKind.INPUT) for stage in stages]
    assert firsts == sorted(firsts)


def test_virtual_option_places_stage_k_on_group_k_mod_p_and_lowers() -> None:
    options = "method=dp,schedule=interleaved,virtual=2,stages=8,microbatches=8"
    module, ctx = _planned(BERT48, options, "1x4xV100-16GB", 16, lower=True)
    _assert_megatron_placement(module, 4)
    assert module.attrs.schedule == "interleaved"
    # `schedule` read V = 2 off the stages: each rank hosts stage g and stage g + 4.
    assert len(module.programs) == 4
    for program in module.programs:
        g = program.attrs.rank
        assert program.attrs.stages == (f"s{g}", f"s{g + 4}")
    assert any("interleaved/v2" in line and "CHOSEN" in line for line in ctx.reports["plan"])


def test_interleaved_without_virtual_lets_the_planner_choose_v() -> None:
    module, _ = _planned(BERT48, "schedule=interleaved,stages=8,microbatches=8", "1x4xV100-16GB", 16)
    virtual = len(module.stages) // len({s.attrs.devices for s in module.stages})
    assert len(module.stages) == 8 and virtual in (2, 4)
    _assert_megatron_placement(module, 8 // virtual)
    free, _ = _planned(BERT48, "schedule=interleaved,microbatches=8", "1x4xV100-16GB", 16)
    groups = len({s.attrs.devices for s in free.stages})
    assert len(free.stages) // groups >= 2
    _assert_megatron_placement(free, groups)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("schedule=1f1b,virtual=2", "only the interleaved schedule runs"),
        ("schedule=interleaved,virtual=3,stages=8", "8 stages do not split into device groups of virtual=3"),
        ("virtual=0", "virtual must be auto or a positive integer"),
        ("schedule=interleaved,virtual=2,stages=16", "each device group holds at most 2 virtual stages"),
        ("schedule=interleaved,virtual=2,stages=2", "make 1 device group; interleaving needs at least two"),
    ],
)
def test_bad_virtual_requests_name_the_culprit(options: str, message: str) -> None:
    with pytest.raises(PassError, match=message):
        _planned(BERT48, options, "1x4xV100-16GB", 16)


@pytest.mark.parametrize(("groups", "virtual", "m"), [(2, 2, 4), (4, 2, 8), (4, 4, 4), (8, 2, 16)])
def test_estimate_is_the_closed_form_on_free_links(groups: int, virtual: int, m: int) -> None:
    # M w + (P - 1) w / V: the bubble of interleaved 1F1B shrinks by V (Megatron, Narayanan et al. 2021).
    f, b, layers = 0.01, 0.02, groups * virtual
    problem = Problem(
        [f] * layers, [b] * layers, [1.0] * layers, [0.0] * layers, [0.0] * layers, [0.0] * layers,
        _ideal(1, 8), global_batch=m, cost_batch=1, batch=1,
    )  # fmt: skip
    base = candidate(problem, [0, *range(virtual, layers + 1, virtual)], [1] * groups, m, "1f1b", "append-first", "t")
    assert base is not None
    cand = interleaved_variant(problem, base, virtual)
    assert cand is not None and len(cand.stages) == layers and cand.groups == groups
    w = virtual * (f + b)
    assert evaluate(problem, cand).iteration_s == pytest.approx(m * w + (groups - 1) * w / virtual)


@pytest.mark.parametrize(
    ("path", "cluster", "global_batch"), [(BERT48, "1x8xV100-16GB", 64), (GNMT16, "2x8xV100-16GB", 1024)]
)
def test_estimate_agrees_with_the_simulator(path: Path, cluster: str, global_batch: int) -> None:
    module, problem = _coarsened(path, cluster, global_batch)
    checked = 0
    for groups in (2, 4, 8):
        bounds = time_balanced_partition(problem, groups)
        assert bounds is not None
        for m in (groups, 4 * groups):
            base = candidate(problem, bounds, [1] * groups, m, "1f1b", "append-first", "t")
            assert base is not None
            for virtual in (2, 4):
                cand = interleaved_variant(problem, base, virtual)
                assert cand is not None
                simulated, _peak = lower_and_simulate(module, problem, cand)
                estimate = evaluate(problem, cand).iteration_s
                # GNMT's residuals feed two later stages; the backward of their producer waits for both
                # gradients. The formula does not see that wait: with 4 virtual stages on 8 devices and only
                # 8 microbatches it shows (19% under the simulation). A known gap of the interleaved model.
                known_gap = path == GNMT16 and virtual == 4 and m == groups == 8
                assert estimate == pytest.approx(simulated, rel=0.25 if known_gap else 0.15), cand.describe()
                checked += 1
    assert checked == 12


def test_every_listed_interleaved_candidate_agrees_with_the_simulator() -> None:
    _, ctx = _planned(BERT48, "schedule=interleaved", "1x8xV100-16GB", 32)
    rows = [line.split() for line in ctx.reports["plan"][2:] if "interleaved/v" in line]
    simulated = [(float(r[8]), float(r[9])) for r in rows if r[9] != "-"]
    assert len(simulated) >= 3
    for model_ms, sim_ms in simulated:
        assert model_ms == pytest.approx(sim_ms, rel=0.15)


def test_auto_interleaves_when_the_bubble_dominates() -> None:
    # BERT-48 on eight V100s with a global batch of 8: at most one microbatch per stage, so 1F1B idles
    # (P - 1) / (M + P - 1) of the time; virtual stages cut that bubble.
    module, ctx = _planned(BERT48, "", "1x8xV100-16GB", 8)
    assert module.attrs.schedule == "interleaved"
    groups = len({s.attrs.devices for s in module.stages})
    assert len(module.stages) > groups
    assert any("CHOSEN" in line and "interleaved/v" in line for line in ctx.reports["plan"])
    chosen_s = module.attrs.predicted_iteration_s
    assert chosen_s is not None
    # The simulator, run here on the 1F1B and GPipe plans of the same device groups, confirms the gain.
    coarse, problem = _coarsened(BERT48, "1x8xV100-16GB", 8)
    bounds = time_balanced_partition(problem, groups)
    assert bounds is not None
    for schedule in ("1f1b", "gpipe"):
        plain = candidate(problem, bounds, [1] * groups, 8, schedule, "append-first", "t")
        assert plain is not None
        plain_s, _peak = lower_and_simulate(coarse, problem, plain)
        assert chosen_s < 0.85 * plain_s


def _compiled_interleaved(out: Path) -> Module:
    """`dapple compile --schedule interleaved --virtual 2 --stages 8` of the MLP on four CPU ranks."""
    return compile_plan(
        MLP, cluster="4xcpu", global_batch=8, stages=8, microbatches=4, schedule="interleaved", virtual=2,
        optimizer="sgd", out_dir=out,
    ).module  # fmt: skip


def test_compiled_interleaved_plan_trains_exactly_on_four_cpu_ranks(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    module = _compiled_interleaved(out)
    _assert_megatron_placement(module, 4)
    assert len(module.programs) == 4 and all(len(p.attrs.stages or ()) == 2 for p in module.programs)
    trained = run(out, steps=2, check=True, transport="threads", optimizer="sgd", lr=0.05, timeout=30)
    ref = train_reference(MLP, seed=0, steps=2, microbatches=4, microbatch_size=2, optimizer="sgd", lr=0.05)
    assert trained.losses == pytest.approx(ref.losses, rel=RTOL, abs=ATOL)
    assert trained.losses[0] != trained.losses[1]
    for tensors in trained.params.values():
        for key, value in tensors.items():
            torch.testing.assert_close(value, ref.params[key.split("/", 1)[1]], rtol=RTOL, atol=ATOL)
    held = {key.split("/", 1)[1] for tensors in trained.params.values() for key in tensors}
    assert held == set(ref.params)
    assert trained.check is not None and trained.check.ok


@pytest.mark.slow
def test_compiled_interleaved_plan_trains_exactly_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    _compiled_interleaved(out)
    result = run(out, steps=2, check=True, transport="torchrun", timeout=60, device="cpu")
    assert result.check is not None and result.check.ok, result.check
    assert result.devices == ["cpu"] * 4


def test_compile_flag_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(DappleError, match="only the interleaved schedule runs"):
        compile_plan(MLP, cluster="4xcpu", global_batch=8, schedule="gpipe", virtual=2)
    out = str(tmp_path / "p")
    args = ["compile", MLP, "--cluster", "4xcpu", "--global-batch", "8", "--microbatches", "4", "-o", out]
    assert main([*args, "--virtual", "2", "--stages", "3"]) != 0
    assert "3 stages do not split into device groups of virtual=2" in capsys.readouterr().err
    assert main([*args, "--virtual", "2"]) == 0
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert plan["schedule"] == "interleaved"
    devices = [tuple(stage["devices"]) for stage in plan["stages"]]
    assert len(devices) > len(set(devices))  # virtual stages share their group's devices
