"""`dapple compile` end to end: the plan directory, --explain, and the errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapple_ir.cli import main
from dapple_ir.sim.simulator import simulate
from tests.paths import PROFILES
from tests.pipeline_fixtures import write_chain_profile

VGG19 = PROFILES / "dapple-vgg-19-pbs-32.txt"


def _compile(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["compile", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _profile(tmp_path: Path, layers: int, fwd_ms: float, params: float) -> Path:
    return write_chain_profile(tmp_path / "graph.txt", [(fwd_ms, 1e6, params)] * layers)


def test_profile_plan_dir_is_complete_and_agrees_with_the_simulator(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan"
    (out).mkdir()
    # An empty directory is fine; what a plan directory owns is by its digest (test_plan_dir_ownership).
    code, stdout, _ = _compile(
        tmp_path, capsys, f"profile:{VGG19}", "--cluster", "2x8xV100-16GB", "--global-batch", "512", "-o", str(out)
    )
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["plan.dapple", "plan.json", "report.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["plan"]  # no temporary directory left beside it
    plan = json.loads((out / "plan.json").read_text())
    nodes = [n for s in plan["stages"] for n in s["nodes"]]
    profile_nodes = [line.split(" -- ")[0] for line in VGG19.read_text().splitlines() if line and line[0] != "\t"]
    assert sorted(nodes) == sorted(profile_nodes)
    devices = [d for s in plan["stages"] for d in s["devices"]]
    assert len(devices) == len(set(devices)) and set(devices) <= set(range(16))
    assert plan["microbatches"] * plan["microbatch_size"] == plan["global_batch"] == 512
    assert plan["ranks"] == len(devices) == len(plan["peak_bytes"])
    assert set(plan["peak_bytes"]) == {str(d) for d in devices}
    assert all(0 < v <= 16e9 for v in plan["peak_bytes"].values())
    assert plan["schedule"] in ("1f1b", "gpipe", "zb-h1", "interleaved")
    # The number shown is the simulator's, so that it and the timeline agree.
    assert plan["predicted_iteration_s"] == pytest.approx(simulate(out).iteration_s, rel=1e-9)
    assert f"{plan['predicted_iteration_s']:.4f}" in stdout


def test_explain_lists_candidates_with_reasons(tmp_path: Path, capsys) -> None:
    code, stdout, _ = _compile(
        tmp_path,
        capsys,
        f"profile:{VGG19}",
        "--cluster",
        "16x1xV100-16GB",
        "--global-batch",
        "512",
        "-o",
        str(tmp_path / "p"),
        "--explain",
    )
    assert code == 0
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if "verdict" in line)
    rows = [line for line in lines[header + 1 :] if line[:5].strip().isdigit()]
    assert sum("CHOSEN" in r for r in rows) == 1
    for name in ("data-parallel", "uniform", "parameter-balanced", "time-balanced", "pipedream"):
        assert any(f"baseline:{name}" in r for r in rows), name
    for row in rows:
        assert "CHOSEN" in row or "lost: " in row or "rejected: " in row
        assert len(row) < 200
    assert any(line.startswith("chosen: s0: layers 0-") for line in lines)


def test_a_cluster_whose_ranks_share_cores_plans_with_the_core_floor(tmp_path: Path, capsys) -> None:
    """`cores_per_node` = 1 under 4 CPU ranks: `--explain` says the ranks share the core and gives the chosen plan's
    core floor, and the prediction (the simulator's) is never below the whole step's compute on that one core,
    where the same cluster with a core per rank predicts less."""
    profile = _profile(tmp_path, 8, 2.0, 1e4)
    predicted = {}
    for cores in (0, 1):
        cluster = tmp_path / f"cores-{cores}.toml"
        cluster.write_text(f'devices_per_node = 4\ndevice = "cpu"\ncores_per_node = {cores}\n')
        out = tmp_path / f"plan-{cores}"
        code, stdout, _ = _compile(
            tmp_path, capsys, f"profile:{profile}", "--profile-batch", "8", "--cluster", str(cluster),
            "--global-batch", "16", "--stages", "4", "--microbatches", "4", "--schedule", "1f1b", "-o", str(out),
            "--explain",
        )  # fmt: skip
        assert code == 0
        shared_line = [line for line in stdout.splitlines() if "share 1 core(s)" in line]
        assert len(shared_line) == cores
        predicted[cores] = json.loads((out / "plan.json").read_text())["predicted_iteration_s"]
        if cores:
            # One core does every rank's work: what the simulator's ranks, a core each, were busy with (their ops
            # and the host's work per instruction and message; the optimizer steps of 320 kB are microseconds).
            work = sum(simulate(tmp_path / "plan-0", cluster=str(tmp_path / "cores-0.toml")).busy_s)
            floor = float(shared_line[0].split("chosen plan's: ")[1].split(" ms")[0]) / 1e3
            assert floor == pytest.approx(work, rel=1e-3)
            assert predicted[cores] >= floor * (1 - 1e-9)
    assert predicted[0] < predicted[1]


def test_microbatches_must_divide_the_global_batch(tmp_path: Path, capsys) -> None:
    code, _, err = _compile(
        tmp_path,
        capsys,
        f"profile:{VGG19}",
        "--cluster",
        "2x8xV100-16GB",
        "--global-batch",
        "64",
        "--microbatches",
        "7",
        "-o",
        str(tmp_path / "p"),
    )
    assert code == 2
    assert "global batch 64 is not divisible into 7 microbatches" in err
    assert not (tmp_path / "p").exists()


def test_more_stages_than_devices(tmp_path: Path, capsys) -> None:
    code, _, err = _compile(
        tmp_path,
        capsys,
        f"profile:{VGG19}",
        "--cluster",
        "2x8xV100-16GB",
        "--global-batch",
        "64",
        "--stages",
        "17",
        "-o",
        str(tmp_path / "p"),
    )
    assert code == 2
    assert "17 stages were requested but cluster 2x8xV100-16GB has only 16 devices" in err


def test_zero_cost_profile(tmp_path: Path, capsys) -> None:
    graph = _profile(tmp_path, layers=4, fwd_ms=0.0, params=1000.0)
    code, _, err = _compile(
        tmp_path,
        capsys,
        f"profile:{graph}",
        "--cluster",
        "2x8xV100-16GB",
        "--global-batch",
        "64",
        "-o",
        str(tmp_path / "p"),
    )
    assert code == 2
    assert "zero forward and backward time" in err


def test_no_plan_fits_names_a_cluster_that_would(tmp_path: Path, capsys) -> None:
    # 40 layers of 3 GB of parameters: 480 GB with Adam's state, more than 16 x 16 GB.
    graph = _profile(tmp_path, layers=40, fwd_ms=1.0, params=3e9)
    code, _, err = _compile(
        tmp_path,
        capsys,
        f"profile:{graph}",
        "--cluster",
        "2x8xV100-16GB",
        "--global-batch",
        "64",
        "-o",
        str(tmp_path / "p"),
    )
    assert code == 2
    assert "no plan fits in memory on 2x8xV100-16GB" in err
    # Each 3 GB layer takes 12 GB with Adam: one layer a device, 40 devices, so 5 nodes of 8.
    assert "The smallest cluster of 8-device nodes that fits is 5x8xV100-16GB" in err


def test_one_layer_too_big_for_any_device(tmp_path: Path, capsys) -> None:
    graph = _profile(tmp_path, layers=2, fwd_ms=1.0, params=5e9)
    code, _, err = _compile(
        tmp_path,
        capsys,
        f"profile:{graph}",
        "--cluster",
        "2x8xV100-16GB",
        "--global-batch",
        "64",
        "-o",
        str(tmp_path / "p"),
    )
    assert code == 2
    assert "alone needs 20.0 GB" in err and "devices with more memory" in err


@pytest.mark.slow
def test_example_model_compiles_with_rank_files_and_model_hash(tmp_path: Path, capsys) -> None:
    from dapple_ir.frontend.spec_loader import capture_spec
    from dapple_ir.ir.structure import structure_hash

    spec = "examples/mlp.py:factory"
    code, _, _ = _compile(
        tmp_path,
        capsys,
        spec,
        "--cluster",
        "4xV100-16GB",
        "--global-batch",
        "32",
        "--stages",
        "2",
        "-o",
        str(tmp_path / "p"),
    )
    assert code == 0
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert len(plan["stages"]) == 2
    assert plan["model_hash"] == structure_hash(capture_spec(spec, device="meta"))
    assert sorted(p.name for p in (tmp_path / "p").glob("rank_*.py")) == [f"rank_{r}.py" for r in range(plan["ranks"])]
