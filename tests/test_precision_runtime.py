"""Mixed precision at run time: bf16 autocast on CPU ranks against the reference under the same autocast, and
fp16's dynamic loss scale with a step that overflows, skipped by every rank, resumed from a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dapple_ir.analysis import memory
from dapple_ir.analysis.peak_memory import program_peak
from dapple_ir.api import compile as compile_plan
from dapple_ir.backends.torch.launch import run
from dapple_ir.backends.torch.reference import train_reference
from dapple_ir.backends.torch.results import RunResult
from tests.paths import ROOT
from tests.test_runtime import GPT, MLP

pytestmark = pytest.mark.slow

#: An MLP whose targets at step 1 are 10^4 times too large: the loss gradient times the fp16 loss scale
#: (2^16) overflows fp16 in the backward of the last matmul, and the step must be skipped everywhere.
OVERFLOWING = """
import torch
import torch.nn.functional as F
from torch import nn


def factory():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, (torch.randn(8, 16),), F.mse_loss, (torch.randn(8, 4),)


def dapple_data(step, global_batch, seed):
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    x, y = torch.randn(global_batch, 16, generator=gen), torch.randn(global_batch, 4, generator=gen)
    return (x,), (y * 1e4 if step == 1 else y,)
"""


def _plan(out: Path, spec: str, precision: str) -> Path:
    compile_plan(spec, cluster="1x2xcpu", global_batch=8, stages=2, microbatches=4, precision=precision, out_dir=out)
    return out


def _checked(result: RunResult) -> None:
    assert result.check is not None and result.check.ok, result.check


@pytest.mark.parametrize("spec", [MLP, GPT], ids=["mlp", "gpt"])
def test_bf16_on_two_processes_trains_like_one_device_under_autocast(spec: str, tmp_path: Path) -> None:
    plan = _plan(tmp_path / "plan", spec, "bf16")
    result = run(plan, steps=2, check=True, transport="torchrun", timeout=60, device="cpu", optimizer="adam", lr=1e-3)
    _checked(result)
    assert result.check is not None
    # An unreplicated split runs the very ops one device runs: the MLP agrees bitwise, the GPT within the
    # rounding of its tied embedding's gradient sum.
    limit = 0.0 if spec == MLP else 1e-7
    assert result.check.max_param_diff <= limit and result.check.max_loss_diff <= limit
    fp32 = train_reference(spec, seed=0, steps=2, microbatches=4, microbatch_size=2, optimizer="adam", lr=1e-3)
    assert result.losses != fp32.losses  # autocast did run: bf16 rounds the losses away from fp32's


#: The transformers Llama of the README (2 layers, hidden 64, grouped-query attention), captured by torch.export.
LLAMA = f"{ROOT}/examples/llama.py:factory"


@pytest.mark.parametrize(
    "layout",
    [dict(cluster="2xcpu"), dict(cluster="4xcpu", data_parallel=2, replication="split", zero="all")],
    ids=["two-stages", "split-replicas-zero-1"],
)
def test_llama_under_bf16_trains_like_one_device_under_autocast(layout: dict[str, object], tmp_path: Path) -> None:
    # torch.export turns each `.to(torch.float32)` that was a no-op at capture (Llama's RMSNorm and its loss's
    # `logits.float()`) into a dtype assert before the `to`; under autocast the value is 16-bit there, and the
    # stages must not assert the capture's fp32 (both stages hold such asserts).
    out = tmp_path / "plan"
    compiled = compile_plan(
        LLAMA, global_batch=8, stages=2, microbatches=4, precision="bf16", optimizer="adam", out_dir=out, **layout
    )  # type: ignore[arg-type]
    module = compiled.module
    asserts = [op for op in module.ops if op.target == "aten._assert_tensor_metadata.default"]
    assert {s.name for s in module.stages for op in s.ops if op in asserts} == {"s0", "s1"}
    replicated = "zero" in layout
    assert all(bool(s.attrs.split) == replicated and bool(s.attrs.zero) == replicated for s in module.stages)
    result = run(out, steps=2, check=True, transport="threads", timeout=120, device="cpu", optimizer="adam", lr=1e-3)
    _checked(result)
    fp32 = train_reference(LLAMA, seed=0, steps=2, microbatches=4, microbatch_size=2, optimizer="adam", lr=1e-3)
    assert result.losses != fp32.losses  # autocast did run


def test_fp16_overflow_is_skipped_by_every_rank_and_the_scale_checkpointed(tmp_path: Path) -> None:
    spec_file = tmp_path / "overflowing.py"
    spec_file.write_text(OVERFLOWING)
    spec = f"{spec_file}:factory"
    plan = _plan(tmp_path / "plan", spec, "fp16")
    opts = {"transport": "threads", "timeout": 60, "optimizer": "sgd", "lr": 0.05}
    whole = run(plan, steps=3, check=True, save=tmp_path / "whole", **opts)  # type: ignore[arg-type]
    _checked(whole)
    ref = train_reference(
        spec, seed=0, steps=3, microbatches=4, microbatch_size=2, optimizer="sgd", lr=0.05, precision="fp16"
    )
    assert ref.skipped_steps == [1]
    states = [torch.load(tmp_path / "whole" / "step_00000003" / f"rank_{r}.pt", weights_only=True) for r in (0, 1)]
    assert [s["loss_scale"] for s in states] == [{"scale": 2.0**15, "good_steps": 1}] * 2  # both ranks backed off
    # A run resumed after the skipped step continues with the backed-off scale, bit for bit.
    run(plan, steps=2, save=tmp_path / "first", **opts)  # type: ignore[arg-type]
    resumed = run(plan, steps=1, resume=tmp_path / "first", **opts)  # type: ignore[arg-type]
    assert resumed.first_step == 2 and resumed.losses == whole.losses[2:]
    for rank, tensors in resumed.params.items():
        for key, value in tensors.items():
            assert torch.equal(value, whole.params[rank][key]), key


def test_bf16_peak_memory_counts_autocasts_weight_copies_per_microbatch_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The memory benchmark's MLP (8 Linear layers of 256 x 256, microbatch 32): each microbatch in flight holds its
    # own bf16 copy of its stage's weights (autocast casts per forward, autograd saves the copy). The runtime's meter
    # is the reference; without the copies the model is 24-35 % short.
    spec = f"{Path(__file__).resolve().parent.parent}/bench/bench_models.py:mlp_memory"
    out = tmp_path / "plan"
    compiled = compile_plan(
        spec, cluster="2xcpu", global_batch=128, stages=2, microbatches=4, schedule="1f1b", precision="bf16",
        optimizer="sgd", out_dir=out,
    )  # fmt: skip
    measured = run(out, steps=2, transport="threads", optimizer="sgd", device="cpu").peak_bytes
    module = compiled.module

    def predicted() -> list[float]:
        return [program_peak(module, program).total for program in module.programs]

    errors = [abs(m - p) / p for m, p in zip(measured, predicted(), strict=True)]
    assert max(errors) < 0.01, errors  # the last stage's loss keeps an fp32 cast of its input, 0.6 %
    monkeypatch.setattr(memory, "autocast_saved_bytes", lambda *_: 0.0)
    assert min(abs(m - p) / p for m, p in zip(measured, predicted(), strict=True)) > 0.2
