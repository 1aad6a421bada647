"""Mixed precision as a plan property (IR text, pricing at annotate time) and MFU with its hardware floor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapple_ir.analysis.mfu import utilization
from dapple_ir.analysis.precision import default_precision, sixteen_bit_values
from dapple_ir.cluster.roofline import roofline_times
from dapple_ir.cluster.spec import PRESETS
from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.errors import DappleError, VerifyError
from dapple_ir.ir.parser import parse_module
from dapple_ir.ir.printer import print_module
from dapple_ir.ir.verifier import verify_module
from dapple_ir.pass_manager import PassManager, build_pipeline
from dapple_ir.pricing.matmul_efficiency import calibration_for
from dapple_ir.registry import PassContext

ROOT = Path(__file__).resolve().parent.parent

#: A transformer block (see the golden file's comment for the autocast rules it exercises).
BLOCK = (Path(__file__).parent / "golden" / "annotate_cost" / "bf16_block.in.dapple").read_text()


def _annotated(precision: str) -> object:
    module = parse_module(BLOCK)
    option = "" if precision == "fp32" else f"{{precision={precision}}}"
    PassManager(build_pipeline(f"annotate-cost{option}")).run(module, PassContext())
    return module


def test_precision_prints_only_when_16_bit_and_round_trips() -> None:
    fp32 = print_module(_annotated("fp32"))  # type: ignore[arg-type]
    assert "precision" not in fp32
    for precision in ("bf16", "fp16"):
        text = print_module(_annotated(precision))  # type: ignore[arg-type]
        assert f'precision = "{precision}"' in text.splitlines()[0]
        assert print_module(parse_module(text)) == text


def test_verifier_names_a_bad_precision() -> None:
    module = parse_module(BLOCK.replace('cluster = "1x1xH100"', 'cluster = "1x1xH100", precision = "fp8"'))
    with pytest.raises(VerifyError, match="precision = 'fp8' must be one of 'bf16', 'fp16'"):
        verify_module(module)


def test_which_values_become_16_bit() -> None:
    module = parse_module(BLOCK)
    half = {op.name for op in sixteen_bit_values(module, "bf16")}
    # The projections and what only they feed are 16-bit; the norm (fp32 weights), the residual add (fp32 + 16-bit
    # promotes), the softmax and the sum (autocast's fp32 list), and what reads them are not.
    assert half == {"fc1", "gelu", "fc2"}
    assert not sixteen_bit_values(module, "fp32")


def test_bf16_prices_matmuls_at_the_16_bit_peak_and_narrows_their_bytes() -> None:
    fp32, bf16 = _annotated("fp32"), _annotated("bf16")
    ops32 = {op.name: op for op in fp32.ops}  # type: ignore[attr-defined]
    ops16 = {op.name: op for op in bf16.ops}  # type: ignore[attr-defined]
    h100 = PRESETS["H100"]
    # A 16-bit GEMM on a preset with published GEMM figures: the size law's efficiency (`matmul_efficiency`).
    cal = calibration_for("H100")
    assert cal is not None and "matmul" not in resolve_cluster("1x1xH100").efficiency
    fc1 = ops16["fc1"]
    weight = 256 * 64 * 4
    moved = weight + (fc1.attrs.mem_bytes - weight) / 2  # activations at 2 bytes, weights read in fp32
    f, b = fc1.attrs.fwd_flops, fc1.attrs.bwd_flops
    # Compute at ceiling x F / (F + half) of the bf16 peak; the bytes at the ceiling of the bandwidth; plus a kernel
    # call, and at least the host's dispatch of the call, which runs ahead of the device.
    at = h100.flops("bf16") * cal.ceiling * f / (f + cal.half_flops)
    bandwidth = h100.mem_bandwidth * cal.ceiling
    expected = (
        max(max(f / at, moved / bandwidth) + h100.op_overhead, h100.host_forward),
        max(max(b / at, 2 * moved / bandwidth) + h100.op_overhead, h100.host_backward),
    )
    assert (fc1.attrs.fwd_s, fc1.attrs.bwd_s) == pytest.approx(expected, rel=1e-12)
    # So small a GEMM (262 kFLOP) cannot fill the tensor cores: under the size law it is no faster than fp32's
    # constant-efficiency price; a large one is (16 GFLOP: 4.1e-5 s at bf16 against 4.2e-4 s at fp32).
    big = (16e9, 32e9)
    assert (
        roofline_times(big, 0.0, h100, "bf16", cal.ceiling, cal.half_flops)[0]
        < roofline_times(big, 0.0, h100, "f32", resolve_cluster("1x1xH100").efficiency_of("matmul"))[0]
    )
    assert fc1.out_bytes == ops32["fc1"].out_bytes / 2 and fc1.attrs.act_bytes == 4096.0
    assert ops16["gelu"].attrs.act_bytes == 4096.0
    for name in ("x", "ln", "add", "soft", "mul"):
        assert ops16[name].out_bytes == ops32[name].out_bytes
        assert ops16[name].attrs.act_bytes == ops32[name].attrs.act_bytes


def test_a_gpu_op_call_costs_the_longer_of_its_kernel_and_the_hosts_dispatch() -> None:
    """On a GPU the host issues a call while earlier kernels run: a chain of tiny kernels runs at the host's pace, a
    big GEMM hides its dispatch; on a CPU rank the dispatch is synchronous and added (no host term)."""
    h100, cpu = PRESETS["H100"], PRESETS["cpu"]
    assert h100.host_forward > h100.op_overhead > 0 and h100.host_backward > 0 and cpu.host_forward == 0
    tiny = roofline_times((1e3, 2e3), 4e3, h100, "bf16")  # 4 kB moved: a nanosecond of work
    assert tiny == (h100.host_forward, h100.host_backward)
    big = (2e12, 4e12)  # a 2 TFLOP GEMM: two milliseconds of work
    work = roofline_times(big, 0.0, h100, "bf16")
    assert work == (big[0] / h100.flops("bf16") + h100.op_overhead, big[1] / h100.flops("bf16") + h100.op_overhead)
    assert roofline_times((1e3, 2e3), 4e3, cpu) == (
        max(1e3 / cpu.flops(), 4e3 / cpu.mem_bandwidth) + cpu.op_overhead,
        max(2e3 / cpu.flops(), 8e3 / cpu.mem_bandwidth) + cpu.op_overhead,
    )
    # The views a capture records run no kernel and cost nothing, on either.
    assert roofline_times((0.0, 0.0), 0.0, h100) == roofline_times((0.0, 0.0), 0.0, cpu) == (0.0, 0.0)


def test_a_16_bit_module_is_not_repriced_at_another_precision() -> None:
    module = _annotated("bf16")
    again = print_module(module)  # type: ignore[arg-type]
    PassManager(build_pipeline("annotate-cost")).run(module, PassContext())  # the module's own precision: fine
    assert print_module(module) == again  # type: ignore[arg-type]
    with pytest.raises(DappleError, match="already priced at bf16"):
        PassManager(build_pipeline("annotate-cost{precision=fp32}")).run(module, PassContext())
    with pytest.raises(DappleError, match="precision must be one of fp32, bf16, fp16, not 'fp8'"):
        PassManager(build_pipeline("annotate-cost{precision=fp8}")).run(parse_module(BLOCK), PassContext())


def test_default_precision_by_device() -> None:
    assert [default_precision(PRESETS[k].peak_flops) for k in ("A100-80GB", "H100", "H200")] == ["bf16"] * 3
    assert default_precision(PRESETS["cpu"].peak_flops) == "fp32"
    assert default_precision(PRESETS["V100-16GB"].peak_flops) == "fp32"  # fp16 needs loss scaling: asked for


# ------------------------------------------------------------------------------------------------ MFU

PLANS = [
    ("examples/gpt.py:factory", "1x4xH100", 16, None),
    ("examples/gpt.py:factory", "1x4xH100", 16, "fp32"),
    ("examples/gpt.py:factory", "2x4xA100-80GB", 32, "bf16"),
    ("examples/mlp.py:factory", "2x8xV100-16GB", 64, "fp16"),
    ("examples/mlp.py:factory", "1x2xcpu", 8, None),
]


@pytest.mark.parametrize(("spec", "cluster", "batch", "precision"), PLANS)
def test_no_prediction_below_the_hardware_floor(
    spec: str, cluster: str, batch: int, precision: str | None, tmp_path: Path
) -> None:
    from dapple_ir.api import compile as compile_plan
    from dapple_ir.sim.simulator import simulate

    result = compile_plan(
        str(ROOT / spec), cluster=cluster, global_batch=batch, precision=precision, out_dir=tmp_path / "p", explain=True
    )
    module = result.module
    used = utilization(module, resolve_cluster(cluster))
    assert used.model_flops > 0 and used.floor_s > 0
    simulated = simulate(tmp_path / "p")
    assert simulated.iteration_s >= used.floor_s, f"{spec} on {cluster}: simulated below the floor"
    assert module.attrs.predicted_iteration_s >= used.floor_s
    meta = json.loads((tmp_path / "p" / "plan.json").read_text())
    expected = precision or ("fp32" if "cpu" in cluster else "bf16")
    assert meta["precision"] == expected and f"precision {expected}" in result.report
    assert "hardware floor" in result.report and "predicted MFU" in result.report


def test_adams_step_bound_is_reached_by_the_worst_gradient_sequence() -> None:
    # Cauchy-Schwarz is tight where g_{t-j} is proportional to (b1 / b2)^j: torch's Adam then steps exactly the bound.
    import torch

    from dapple_ir.backends.torch.tolerances import ADAM_BETAS, adam_reach, adam_step_bound

    b1, b2 = ADAM_BETAS
    for t in (1, 2, 5, 20):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.Adam([p], lr=1.0, betas=ADAM_BETAS, eps=0.0, foreach=False)
        for k in range(t):
            before = float(p.detach())
            p.grad = torch.tensor([(b1 / b2) ** (t - 1 - k)])
            opt.step()
        assert abs(before - float(p.detach())) == pytest.approx(adam_step_bound(t), rel=1e-6)
    assert adam_step_bound(1) == 1.0 and adam_reach(1e-3, 5) == pytest.approx(2e-3 * 5.022, rel=1e-3)
