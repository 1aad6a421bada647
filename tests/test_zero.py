"""Sharded optimizer state (ZeRO-1) at run time: a 2-replica stage with `zero = 1` trains like one device.

On gloo and the threads transport the reduce-scatter is the allreduce with each replica keeping its chunk, so
a sharded plan's parameters equal the unsharded plan's bit for bit; both equal the single-device reference
within the rounding of the replicas' gradient sum (the tolerance `--check` states for replication).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dapple_ir.backends.torch.launch import run
from dapple_ir.backends.torch.results import RunResult
from tests.test_runtime import GPT, MLP, make_plan

pytestmark = pytest.mark.slow

OPTIONS = {"optimizer": "adam", "lr": 1e-3, "timeout": 60.0}


def _plan(out: Path, spec: str, zero: bool) -> Path:
    return make_plan(out, spec, stages=2, replicas=[1, 2], kind="1f1b", optimizer="adam", lr=1e-3, zero=(1,) * zero)


def _same_params(a: RunResult, b: RunResult) -> None:
    assert a.params.keys() == b.params.keys()
    for rank, tensors in a.params.items():
        for key, value in tensors.items():
            assert torch.equal(value, b.params[rank][key]), (rank, key)


def test_the_plan_text_and_rank_files_carry_the_shard_collectives(tmp_path: Path) -> None:
    plan = _plan(tmp_path, MLP, zero=True)
    text = (plan / "plan.dapple").read_text()
    assert "zero = 1" in text
    assert text.count("reduce_scatter @s1 group = [1, 2]") == 2 and text.count("all_gather @s1 group = [1, 2]") == 2
    assert "allreduce @s1" not in text
    source = (plan / "rank_2.py").read_text()
    assert source.index('rt.reduce_scatter("s1"') < source.index("rt.optimizer_step()")
    assert source.index("rt.optimizer_step()") < source.index('rt.all_gather("s1"')


@pytest.mark.parametrize("spec", [MLP, GPT], ids=["mlp", "gpt"])
def test_sharded_replicas_on_gloo_train_like_one_device(spec: str, tmp_path: Path) -> None:
    opts = {"transport": "torchrun", "device": "cpu", **OPTIONS}
    sharded = run(_plan(tmp_path / "zero", spec, True), steps=3, check=True, **opts)  # type: ignore[arg-type]
    assert sharded.check is not None and sharded.check.ok, sharded.check
    # The same sums as the unsharded plan's allreduce on gloo: the same bits.
    whole = run(_plan(tmp_path / "plain", spec, False), steps=3, **opts)  # type: ignore[arg-type]
    _same_params(sharded, whole)
    assert sharded.losses == whole.losses


def test_each_rank_checkpoints_its_shard_and_resumes_bitwise(tmp_path: Path) -> None:
    plan = _plan(tmp_path / "plan", MLP, zero=True)
    opts = {"transport": "threads", **OPTIONS}
    whole = run(plan, steps=4, check=True, **opts)  # type: ignore[arg-type]
    assert whole.check is not None and whole.check.ok, whole.check
    run(plan, steps=2, save=tmp_path / "ckpt", **opts)  # type: ignore[arg-type]
    states = [torch.load(tmp_path / "ckpt" / "step_00000002" / f"rank_{r}.pt", weights_only=True) for r in (1, 2)]
    exp_avgs = [[s["exp_avg"] for s in state["optimizer"]["state"].values()] for state in states]
    assert [len(t) for t in exp_avgs] == [1, 1]  # one flat shard each, not one tensor per parameter
    assert exp_avgs[0][0].numel() == exp_avgs[1][0].numel()  # equal halves of the stage's parameters
    assert not torch.equal(exp_avgs[0][0], exp_avgs[1][0])
    resumed = run(plan, steps=2, resume=tmp_path / "ckpt", **opts)  # type: ignore[arg-type]
    assert resumed.first_step == 2 and resumed.losses == whole.losses[2:]
    _same_params(resumed, whole)


def test_a_sharded_rank_holds_half_the_optimizer_state(tmp_path: Path) -> None:
    opts = {"transport": "threads", **OPTIONS}
    sharded = run(_plan(tmp_path / "zero", MLP, True), steps=2, **opts)  # type: ignore[arg-type]
    whole = run(_plan(tmp_path / "plain", MLP, False), steps=2, **opts)  # type: ignore[arg-type]
    assert sharded.peak_bytes[2] < whole.peak_bytes[2]
    assert sharded.peak_bytes[0] == whole.peak_bytes[0]


def test_the_memory_model_counts_the_shard_and_the_meter_agrees(tmp_path: Path) -> None:
    from dapple_ir.plan_dir import load_plan

    opts = {"transport": "threads", **OPTIONS}
    predicted, measured = {}, {}
    for zero in (False, True):
        plan = _plan(tmp_path / str(zero), MLP, zero)
        predicted[zero] = load_plan(plan).module.programs[2].attrs.peak_bytes or 0.0
        measured[zero] = run(plan, steps=2, **opts).peak_bytes[2]  # type: ignore[arg-type]
        assert measured[zero] == pytest.approx(predicted[zero], rel=0.02)
    # Adam's two moments of s1's parameters, halved: the rank's peak falls by one moment's worth.
    assert predicted[False] - predicted[True] == pytest.approx(measured[False] - measured[True], rel=0.01)
